"""Drift gates: what decides the tau a replay scan admits by (`D(g) <= tau`).

A gate is any object with an attribute `tau: float` (read before each selection) and a method
`update(drifts: Tensor, admitted: Tensor) -> None`, called once after each selection with the
drifts `[n]` of the `n` candidates the scan scored and whether each was admitted (`[n]` bool;
both empty when the rule scored nothing). `FixedGate` is the paper's constant tau. A gate with
state of its own may add `state_dict() -> dict` and `load_state_dict(dict)` (JSON values); the
replay lifecycle (`trainer.primitive.GroupReplay`) saves and restores them with its buffer.
Pure: imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

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
