"""The prompt and rollout settings a policy was trained with, saved beside its weights.

A policy only works with the prompt it learned (the tiny policy answers nothing under the
default instruct prompt), so every model hdr saves (`hdr sft`'s output, each checkpoint's
`model/`, a run's `final/`) carries `hdr_rollout.yaml`:

    rollout:    the whole RolloutConfig (prompt, turns, token budgets, doc_words, temperature)
    retrieval:  the retriever and topk it was trained against (not the URLs: they belong to
                the machine, not to the model)

`hdr rollout` and `hdr eval` read it by default, below anything given on their command line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from core.errors import UserError

SETTINGS_FILE = "hdr_rollout.yaml"
RETRIEVAL_KEYS = ("retriever", "topk")


def settings_yaml(rollout, retrieval) -> str:
    """The file's text for a RolloutConfig and a RetrievalConfig."""
    data = {
        "rollout": rollout.model_dump(mode="json"),
        "retrieval": {key: getattr(retrieval, key) for key in RETRIEVAL_KEYS},
    }
    return yaml.safe_dump(data, sort_keys=False)


def load_settings(model_dir: str | Path) -> dict[str, Any] | None:
    """The saved mapping (`rollout`, `retrieval` sections), or None when the model has none."""
    path = Path(model_dir) / SETTINGS_FILE
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a mapping with rollout and retrieval sections")
    return data


def apply_saved(data: dict[str, Any], saved: dict[str, Any]) -> None:
    """Fill `data` (a config mapping with `rollout`/`retrieval` sections) from `saved`, key by
    key, without replacing anything `data` already sets."""
    for section, values in saved.items():
        if not isinstance(values, dict):
            continue
        target = data.setdefault(section, {})
        if isinstance(target, dict):
            for key, value in values.items():
                target.setdefault(key, value)
