"""Staleness rules: which late groups of an asynchronous rollout enter the update.

A group sampled by the weights of update `v` and trained at the update after `u` (the
trainer's version) is `lag = u - v` updates late. With rollouts running ahead of the trainer
(`trainer/async_rollout.py`), every fresh group has a lag in `0 .. max_lag`; a late group
(lag >= 1) is, to the drift gate, the same object as a replayed group: its tokens and the
log-probs of an older policy. Its Policy Drift under the current weights is
`D(g) = mean over policy tokens of (logprob_current - logprob_sampler)^2` (L2; L1: `|.|`),
the same `trainer.replay.policy_drift` the replay gate reads.

Three rules, registered by name in `STALENESS_RULES` (configs name them as `async_rollout.rule`):

- `version_bound` (AReaL's `max_head_offpolicyness`, TRL's `max_staleness`): admit a group
  when `lag <= max_lag`; drift is measured and logged but not used.
- `drift_gate`: admit a late group when `D(g) <= tau` (a fixed tau), and never one with
  `lag > max_lag` (the hard version cap keeps the queue bounded).
- `adaptive_drift_gate`: the drift gate whose tau follows an `AdaptiveGate`, a controller
  that moves tau in log space after every update to hold a declared target: an acceptance
  rate of late groups, or a drift budget (the mean drift of the late groups admitted).

Every rule admits every on-time group (lag 0): those are the synchronous loop's groups, so a
run whose rollouts are never late is exactly the synchronous loop whatever the rule.

How it departs from the counting rules it is compared with: they decide by the lag alone;
the drift rules pay one teacher-forced pass per late group for the decision (hdr's loop
already runs that pass over every fresh group for the behaviour log-probs, so the pass costs
nothing extra there; the ledger counts it as `cost_gate_tf_tokens`). The gates themselves
(`FixedGate`, `AdaptiveGate`) are `trainer.gate`'s, shared with the replay lifecycle. Pure:
imports torch, core.registry and trainer.gate only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from core.registry import Registry

AdmitFn = Callable[[Tensor, Tensor, float, int], Tensor]
"""`admit(drifts [n], lags [n], tau, max_lag) -> admitted [n] bool`."""


@dataclass(frozen=True)
class StalenessRule:
    """A staleness rule: its admission function and whether its tau adapts online."""

    admit: AdmitFn
    adaptive: bool = False
    uses_drift: bool = True


STALENESS_RULES: Registry[StalenessRule] = Registry("staleness rule")


def version_bound(drifts: Tensor, lags: Tensor, tau: float, max_lag: int) -> Tensor:
    """Admit when `lag <= max_lag` (tau and the drifts unused). `drifts`, `lags`: `[n]`."""
    return lags <= max_lag


def drift_gate(drifts: Tensor, lags: Tensor, tau: float, max_lag: int) -> Tensor:
    """Admit an on-time group always, a late one when `D(g) <= tau` and `lag <= max_lag`.

    `drifts`: `[n]` float, `lags`: `[n]` int. Returns `[n]` bool."""
    on_time = lags <= 0
    return on_time | ((drifts <= tau) & (lags <= max_lag))


STALENESS_RULES.register("version_bound")(StalenessRule(version_bound, uses_drift=False))
STALENESS_RULES.register("drift_gate")(StalenessRule(drift_gate))
STALENESS_RULES.register("adaptive_drift_gate")(StalenessRule(drift_gate, adaptive=True))


@dataclass
class Admission:
    """One step's decision over its fresh groups (`[n]` each, in the step's group order)."""

    lags: Tensor  # int64
    drifts: Tensor  # float32, D(g) under the current weights (0-lag groups included)
    admitted: Tensor  # bool
    tau: float  # the tau the decision used (inf for version_bound)

    @property
    def late(self) -> Tensor:
        return self.lags > 0

    @property
    def late_admitted_share(self) -> float | None:
        """Admitted late groups / late groups; None when none was late."""
        late = self.late
        return float(self.admitted[late].float().mean()) if late.any() else None


def decide(rule: StalenessRule, gate, drifts: Tensor, lags: Tensor, max_lag: int) -> Admission:
    """Apply `rule` with the gate's current tau, then let the gate learn from the late groups
    (on-time groups are admitted by every rule and say nothing about tau)."""
    tau = float(gate.tau) if rule.uses_drift else math.inf
    admitted = rule.admit(drifts, lags, tau, max_lag)
    late = lags > 0
    gate.update(drifts[late], admitted[late])
    return Admission(lags=lags, drifts=drifts, admitted=admitted, tau=tau)


def as_tensors(drifts: list[float], lags: list[int]) -> tuple[Tensor, Tensor]:
    """`[n]` float32 drifts and `[n]` int64 lags."""
    return torch.tensor(drifts, dtype=torch.float32), torch.tensor(lags, dtype=torch.long)
