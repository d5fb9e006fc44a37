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
nothing extra there; the ledger counts it as `cost_gate_tf_tokens`). Pure: imports torch and
core.registry only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

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


def adapt_tau(
    tau: float, measured: float, target: float, rate: float, lo: float, hi: float
) -> float:
    """One step of the log-space controller: `tau * exp(rate * e)`, clipped to `[lo, hi]`,
    with the relative error `e = clip((target - measured) / target, -1, 1)`.

    Measured below target (too few late groups admitted, or less drift than the budget)
    raises tau; above lowers it. Multiplicative steps keep tau positive and make the step
    size independent of tau's scale, which spans decades between models."""
    error = max(-1.0, min(1.0, (target - measured) / target))
    return float(min(hi, max(lo, tau * math.exp(rate * error))))


@dataclass
class AdaptiveGate:
    """A drift gate whose `tau` holds `target` online (the `trainer.gate` interface: `tau`,
    `update(drifts, admitted)`, and `state_dict` / `load_state_dict` for checkpoints).

    `kind="acceptance"`: `target` is the share of scored groups admitted (in (0, 1]);
    `kind="drift_budget"`: `target` is the mean drift of the admitted groups. After each
    decision, `update` measures that quantity over the groups just scored and moves tau by
    `adapt_tau`. A decision that scored nothing leaves tau as it is; one that admitted
    nothing measures a drift of 0 for the budget (below it: tau rises). `last_measured` is
    the measurement of the latest update (NaN before), logged per step."""

    tau: float
    target: float
    kind: Literal["acceptance", "drift_budget"] = "acceptance"
    rate: float = 0.1
    tau_min: float = 1e-8
    tau_max: float = 1e4
    last_measured: float = math.nan

    def __post_init__(self) -> None:
        if self.kind not in ("acceptance", "drift_budget"):
            raise ValueError(f"kind must be acceptance or drift_budget, got {self.kind!r}")
        if not self.target > 0 or (self.kind == "acceptance" and self.target > 1):
            raise ValueError(f"target {self.target} is out of range for {self.kind}")
        if not 0 < self.tau_min <= self.tau <= self.tau_max:
            raise ValueError(f"tau {self.tau} must lie in [{self.tau_min}, {self.tau_max}]")

    def measure(self, drifts: Tensor, admitted: Tensor) -> float:
        """The controlled quantity of one decision: `[n]` drifts, `[n]` bool admitted."""
        if self.kind == "acceptance":
            return float(admitted.float().mean())
        taken = drifts[admitted]
        return float(taken.float().mean()) if len(taken) else 0.0

    def update(self, drifts: Tensor, admitted: Tensor) -> None:
        if len(drifts) == 0:
            return
        self.last_measured = self.measure(drifts, admitted)
        self.tau = adapt_tau(
            self.tau, self.last_measured, self.target, self.rate, self.tau_min, self.tau_max
        )

    def state_dict(self) -> dict[str, float]:
        return {"tau": self.tau, "last_measured": self.last_measured}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.tau = float(state["tau"])
        self.last_measured = float(state["last_measured"])


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
