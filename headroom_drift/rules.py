"""Every replay rule by name, in one registry: a config's `arm` is looked up here and nowhere
else.

The paper's comparison arms are one table of `OrderedReplay`s (ordering x re-scoring x gate x
norm, all sharing one scan); the two published GRPO rules are `SampledReplay`s:

    rule                        ordering   re-scored  gated  norm
    on_policy                   none       -          -      -       (no replay)
    replay_recency              newest     no         no     -       (naive replay)
    headroom_only               headroom   yes        no     -
    drift_only                  newest     yes        yes    params'
    headroom_drift              headroom   yes        yes    params' (L2 by default)
    headroom_drift_l1           headroom   yes        yes    L1
    replay_freshness_per        drawn by |r| x exp(-age / tau_age), importance weighted
    replay_zero_variance_swap   drawn by sum|A| x std(r), for the step's flat groups

`register_rule` adds a rule of your own (a `Selector`: a callable with a `params_type`); a
duplicate name is refused, and an unknown name is one line listing the valid ones.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Generic, TypeVar

from headroom_drift.published import (
    FreshnessParams,
    SampledReplay,
    SwapParams,
    draw_by_freshness,
    draw_for_flat_groups,
)
from headroom_drift.selection import OrderedReplay, Selector, by_headroom, by_recency

T = TypeVar("T")


class Names(Generic[T]):
    """Named variants: refuses a duplicate name; a miss is a ValueError listing the names."""

    def __init__(self, kind: str, entries: dict[str, T] | None = None) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        for name, entry in (entries or {}).items():
            self.register(name, entry)

    def register(self, name: str, entry: T) -> T:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove `name` (a test's temporary entry); an unknown name is a KeyError."""
        del self._entries[name]

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def items(self):
        return self._entries.items()

    def __contains__(self, name: object) -> bool:
        return name in self._entries


ARMS: dict[str, OrderedReplay] = {
    "on_policy": OrderedReplay(None, rescore=False, gated=False),
    "replay_recency": OrderedReplay(by_recency, rescore=False, gated=False),
    "headroom_only": OrderedReplay(by_headroom, rescore=True, gated=False),
    "drift_only": OrderedReplay(by_recency, rescore=True, gated=True),
    "headroom_drift": OrderedReplay(by_headroom, rescore=True, gated=True),
    "headroom_drift_l1": OrderedReplay(by_headroom, rescore=True, gated=True, norm="l1"),
}
"""The paper's comparison arms (the table above)."""

RULES: Names[Selector] = Names(
    "replay rule",
    {
        **ARMS,
        "replay_freshness_per": SampledReplay(draw_by_freshness, FreshnessParams),
        "replay_zero_variance_swap": SampledReplay(draw_for_flat_groups, SwapParams),
    },
)


def register_rule(name: str, rule: Selector) -> Selector:
    """Add a replay rule of your own under `name` (refused if the name is taken)."""
    return RULES.register(name, rule)


def is_gated(name: str) -> bool:
    """Whether rule `name` admits by a drift gate (an adaptive gate has something to move)."""
    rule = RULES.get(name)
    return isinstance(rule, OrderedReplay) and rule.gated


def rule_params(name: str, **knobs: Any):
    """Rule `name`'s params dataclass filled from `knobs`: the fields it has are taken, the
    others ignored (one set of knobs serves every rule: `budget`, `tau`, `norm`, `chunk`,
    `tau_age`, `is_beta_start`, `total_steps`, `seed`); a field missing from `knobs` keeps
    its default."""
    params_type = RULES.get(name).params_type
    return params_type(**{f.name: knobs[f.name] for f in fields(params_type) if f.name in knobs})
