"""How the experiment's settings changed since hdr first recorded them (beside
`trainer/config/history.py`, which keeps the training config's). A preset or override that
names an old key is refused in one line naming the new spelling; an `experiment_config.json`
that hdr itself wrote earlier (`hdr report --from`) is read as today's settings
(`read_as_today`)."""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterable
from typing import Any

from core.config import apply_override, move_renamed, renamed_in

EXPERIMENT_RENAMED = {
    "steps": "train.steps",
    "batch_prompts": "train.grpo.batch_prompts",
    "group_size": "train.grpo.group_size",
    "lr": "train.grpo.lr",
    "tau": "train.replay.tau",
    "tau_age": "train.replay.tau_age",
    "eval_every": "train.eval.every",
    "eval_num_questions": "train.eval.num_questions",
    "eval_k": "train.eval.k",
    "retriever": "train.retrieval.retriever",
    "train_split": "train.data.train_split",
}
"""Flat keys the experiment once kept for training settings, and the TrainConfig key under
`train` each is now: one vocabulary for a run's settings, the training config's."""

TRAIN_OVERRIDES = "train_overrides"
"""The old list of dotted TrainConfig overrides for every run; each is now a key under `train`."""

RETIRED_KEYS = ("bootstrap_resamples",)
"""Keys an older experiment_config.json may hold that no longer mean anything (dropped)."""


def old_key_named(data: Any) -> str | None:
    """One line for the first old key `data` holds, naming its spelling today; None when it
    holds none."""
    if not isinstance(data, dict):
        return None
    if TRAIN_OVERRIDES in data:
        written = data[TRAIN_OVERRIDES]
        items = written if isinstance(written, list) else [written]
        spelled = " ".join(f"train.{item}" for item in items) or "train.KEY=VALUE"
        return f"{TRAIN_OVERRIDES} is now train (TrainConfig keys): write {spelled}"
    return renamed_in(data, EXPERIMENT_RENAMED)


def train_key_meant(data: Any, fields: Iterable[str]) -> str | None:
    """One line for a key `data` holds that is none of `fields` but close to an old flat
    training key (`step`): it names the key under `train` it most likely meant."""
    if not isinstance(data, dict):
        return None
    for key in data:
        if key in fields:
            continue
        close = difflib.get_close_matches(str(key), list(EXPERIMENT_RENAMED), n=1, cutoff=0.75)
        if close:
            return f"unknown config key {key}; did you mean {EXPERIMENT_RENAMED[close[0]]}?"
    return None


def read_as_today(written: dict[str, Any]) -> dict[str, Any]:
    """An experiment_config.json hdr wrote earlier, under today's keys: each old flat key moved
    under `train` (one holding None meant "the base config's" and is dropped), each old
    `train_overrides` entry set there, retired keys dropped."""
    data = copy.deepcopy(written)
    for key in RETIRED_KEYS:
        data.pop(key, None)
    for old in EXPERIMENT_RENAMED:
        if old in data and data[old] is None:
            del data[old]
    overrides = data.pop(TRAIN_OVERRIDES, [])
    data = move_renamed(data, EXPERIMENT_RENAMED)
    train = data.setdefault("train", {})
    for override in overrides:
        apply_override(train, override)
    return data
