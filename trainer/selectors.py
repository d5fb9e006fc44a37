"""The replay rules of `trainer.replay`, registered by name, as configs name them (`arm:`):
an unknown name is one line listing the valid ones, a duplicate name is refused; and each
rule's params filled from a config's `replay` section (`select_params`). Kept apart from
`trainer.replay` so that the primitive itself imports nothing but torch."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from core.registry import Registry
from trainer.replay import RULES, Selector

SELECTORS: Registry[Selector] = Registry("replay selector")
for _name, _rule in RULES.items():
    SELECTORS.register(_name)(_rule)


def select_params(arm: str, replay: Any, budget: int, seed: int, total_steps: int):
    """The rule `arm`'s params dataclass (`ScanParams`, `FreshnessParams`, `SwapParams`)
    filled from `replay` (a `trainer.config.ReplayConfig`) and the run (its seed and
    length)."""
    knobs = {
        "budget": budget,
        "tau": replay.tau,
        "norm": replay.drift_norm,
        "chunk": replay.scan_chunk,
        "seed": seed,
        "total_steps": total_steps,
        "tau_age": replay.tau_age,
        "is_beta_start": replay.is_beta_start,
    }
    params_type = SELECTORS.get(arm).params_type
    return params_type(**{f.name: knobs[f.name] for f in fields(params_type)})
