"""The `TrainConfig` of each run: the base YAML, the experiment's `train` laid over it, the
run's own settings, then the arm's."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from core.config import (
    apply_override,
    build_config,
    lookup,
    merge_settings,
    read_config_file,
    unknown_key_hint,
)
from core.errors import UserError
from experiment.arms import Arm
from experiment.config import ExperimentConfig


def _laid(settings: dict[str, Any], dotted: str) -> Any:
    """The setting at `dotted` as laid so far, else TrainConfig's default."""
    from trainer.config import TrainConfig

    found = lookup(settings, dotted)
    if found is not None:
        return found[0][found[1]]
    first, *rest = dotted.split(".")  # TrainConfig's default (its `model` has none to build)
    node = TrainConfig.model_fields[first].get_default(call_default_factory=True)
    for attr in rest:
        node = getattr(node, attr)
    return node


def _train_config(cfg: ExperimentConfig, own: Sequence[str]):
    """The base YAML; under `train`, what the experiment sets unless `train` does (replay.tau_age
    steps / 4, grpo.warmup_steps min(3, steps - 1), no checkpoints); `train`; then what the
    experiment sets for every run (the task, r from replay_ratio, progress) and `own`."""
    from trainer.config import TrainConfig

    if not Path(cfg.base_config).is_file():
        raise UserError(f"base config not found: {cfg.base_config}")
    base = read_config_file(cfg.base_config)
    laid = merge_settings(base, cfg.train)
    steps, b = _laid(laid, "steps"), _laid(laid, "grpo.batch_prompts")
    unless_set = ["checkpoint.save_every=0"]
    if isinstance(steps, int):  # else the validation below names the bad steps
        unless_set += [
            f"replay.tau_age={max(1.0, steps / 4)}",
            f"grpo.warmup_steps={min(3, steps - 1)}",
        ]
    for override in unless_set:
        apply_override(base, override)
    every_run = [
        f"data.train={cfg.task}",
        f"data.eval={cfg.task}",
        f"log.progress={str(cfg.progress).lower()}",
    ]
    if isinstance(b, int):
        every_run.append(f"replay.budget={max(1, round(cfg.replay_ratio * b))}")
    return build_config(TrainConfig, merge_settings(base, cfg.train), [*every_run, *own])


def shared_train_config(cfg: ExperimentConfig):
    """The training settings every run shares (before its seed, folder, server and arm): where
    the experiment reads b, steps, r, the retriever and RL's split. A bad key or value under
    `train` is one UserError line."""
    try:
        return _train_config(cfg, [])
    except UserError as err:
        if str(err).startswith("base config not found"):
            raise
        raise UserError(f"train (over {cfg.base_config}): {err}") from None


def unknown_train_key(train: dict[str, Any]) -> str | None:
    """One line for the first key under `train` that TrainConfig does not have (None when it
    has them all); values are checked once `train` is laid over the base config."""
    from trainer.config import TrainConfig

    try:
        TrainConfig.model_validate(train)
    except ValidationError as err:
        for error in err.errors():
            if error["type"] == "extra_forbidden":
                where = ".".join(str(p) for p in error["loc"])
                hint = unknown_key_hint(TrainConfig, error["loc"]).replace(" mean ", " mean train.")
                return f"unknown config key train.{where}{hint}"
    return None


def base_train_config(
    cfg: ExperimentConfig,
    url: str,
    sft_dir: Path,
    out_dir: Path,
    seed: int,
    extra: Sequence[str] = (),
):
    """The TrainConfig every arm starts from: `shared_train_config` with the run's seed, folder,
    start and server, then `extra`."""
    own = [
        f"seed={seed}",
        f"out_dir={out_dir}",
        f"model.path={sft_dir}",
        f"retrieval.urls=[{json.dumps(url)}]",
    ]
    return _train_config(cfg, [*own, *extra])


def arm_train_config(
    cfg: ExperimentConfig, arm: Arm, url: str, sft_dir: Path, run_dir: Path, seed: int
):
    """`base_train_config` with the arm's replay rule, fresh batch and replay budget; the L1 arm
    gets `tau_l1` (sqrt of the L2 tau when unset)."""
    base = base_train_config(cfg, url, sft_dir, run_dir, seed)
    fresh = round(arm.fresh * base.grpo.batch_prompts)
    extra = [f"replay.rule={arm.rule}", f"grpo.batch_prompts={fresh}"]
    if not arm.replays:
        extra.append("replay.budget=0")
    if arm.rule == "headroom_drift_l1":
        extra.append(f"replay.tau={cfg.tau_l1 or math.sqrt(base.replay.tau)}")
    return base_train_config(cfg, url, sft_dir, run_dir, seed, [*extra, *arm.overrides])
