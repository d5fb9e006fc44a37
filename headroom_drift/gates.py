"""Drift gates: what decides the tau a replay scan admits by (`D(g) <= tau`).

A gate is any object with an attribute `tau: float` (read before each selection) and a method
`update(drifts: Tensor, admitted: Tensor) -> None`, called once after each selection with the
drifts `[n]` of the `n` candidates the scan scored and whether each was admitted (`[n]` bool;
both empty when the rule scored nothing). `FixedGate` is the paper's constant tau;
`AdaptiveGate` moves tau online (a log-space controller, `adapt_tau`) to hold a declared
target: an acceptance rate, or a drift budget (the admitted groups' mean drift). The same
gates decide late groups of an asynchronous rollout (`headroom_drift.staleness`). A gate with
state of its own may add `state_dict() -> dict` and `load_state_dict(dict)` (plain values);
the replay lifecycle (`headroom_drift.GroupReplay`) saves and restores them with its buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class Gate(Protocol):
    """The gate interface: `tau` now, and what the last scan measured."""

    tau: float

    def update(self, drifts: Tensor, admitted: Tensor) -> None: ...


@dataclass
class FixedGate:
    """A constant drift gate: admits a candidate when its drift is at most `tau`."""

    tau: float

    def update(self, drifts: Tensor, admitted: Tensor) -> None:
        """Nothing to learn: the threshold stays `tau`."""


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
    """A drift gate whose `tau` holds `target` online (the `Gate` interface: `tau`,
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
