"""Every replay rule by name, in one table: a config's `replay.rule` is looked up here and
nowhere else.

The paper's comparison rules are one table of `OrderedReplay`s (ordering x re-scoring x gate x
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

`register_rule` adds a rule of your own (a `ReplayRule`: a callable with a `params_type`); a
duplicate name is refused, and an unknown name is one line listing the valid ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

from headroom_drift.published import (
    FreshnessParams,
    SampledReplay,
    SwapParams,
    draw_by_freshness,
    draw_for_flat_groups,
)
from headroom_drift.selection import OrderedReplay, ReplayRule, by_headroom, by_recency

T = TypeVar("T")

ORDERED_RULES: dict[str, OrderedReplay] = {
    "on_policy": OrderedReplay(None, rescore=False, gated=False),
    "replay_recency": OrderedReplay(by_recency, rescore=False, gated=False),
    "headroom_only": OrderedReplay(by_headroom, rescore=True, gated=False),
    "drift_only": OrderedReplay(by_recency, rescore=True, gated=True),
    "headroom_drift": OrderedReplay(by_headroom, rescore=True, gated=True),
    "headroom_drift_l1": OrderedReplay(by_headroom, rescore=True, gated=True, norm="l1"),
}
"""The paper's comparison table (above): one scan, ordering x re-scoring x gate x norm."""

RULES: dict[str, ReplayRule] = {
    **ORDERED_RULES,
    "replay_freshness_per": SampledReplay(draw_by_freshness, FreshnessParams),
    "replay_zero_variance_swap": SampledReplay(draw_for_flat_groups, SwapParams),
}
"""Every replay rule by name: read it with `replay_rule`, add to it with `register_rule`."""


def named(table: Mapping[str, T], kind: str, name: str) -> T:
    """`table[name]`; a miss is a ValueError listing the valid names, which a config's validator
    turns into its one-line error (a typo is named where it was written, not deep in a run)."""
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(table))}")
    return table[name]


def replay_rule(name: str) -> ReplayRule:
    """The replay rule called `name` (a ValueError listing the valid names on a miss)."""
    return named(RULES, "replay rule", name)


def register_rule(name: str, rule: ReplayRule) -> ReplayRule:
    """Add a replay rule of your own under `name` (refused if the name is taken; a test's
    temporary rule leaves with `del RULES[name]`)."""
    if name in RULES:
        raise ValueError(f"replay rule {name!r} is already registered")
    RULES[name] = rule
    return rule


def is_gated(name: str) -> bool:
    """Whether rule `name` admits by a drift gate (an adaptive gate has something to move)."""
    rule = replay_rule(name)
    return isinstance(rule, OrderedReplay) and rule.gated


def rule_params(name: str, **knobs: Any):
    """Rule `name`'s params dataclass filled from `knobs`: the fields it has are taken, the
    others ignored (one set of knobs serves every rule: `budget`, `tau`, `norm`, `chunk`,
    `tau_age`, `is_beta_start`, `total_steps`, `seed`); a field missing from `knobs` keeps
    its default."""
    params_type = replay_rule(name).params_type
    return params_type(**{f.name: knobs[f.name] for f in fields(params_type) if f.name in knobs})
