"""The precondition of the replay comparison, measured: do more fresh rollouts buy quality on
this bed at all?

"Replay stands in for fresh rollouts" is testable only where fresh rollouts help. On the
powered wiki-vital bed they did not (`on_policy_larger` - `on_policy` +0.003 Mean@8
[-0.004, +0.010]), so its headline had no content. Before any replay arm runs, a
dose-response pilot trains `on_policy` at several fresh-prompt counts per step (b = 4, 6, 8,
12, 16; variants of `on_policy`), 2+ seeds, the full test set, and the gate (`gate`) says GO
only if the 1.5x step's gain (b = 12 over b = 8, paired by seed and question) is at least
`ratio` (2) times the minimum detectable effect of the planned comparison at its design
(seeds x questions x k).

The planned comparison (`headroom_drift` - `on_policy`) cannot be measured in a pilot that
runs no replay arm; its variance components are taken from the dose step's own paired
difference (b = 12 - b = 8), the nearest contrast of the same kind the pilot has: two learning
arms on the same seeds, prompts and questions. Its residual's sampling-noise part is rescaled
to the planned k (`Components.se`).

The beds to search, their order, the stop rule and each pilot's CPU-hour budget are declared
in the preset (`configs/experiments/pilot-dose-response.yaml`, `Precondition`) before the first
pilot runs; `pilot_bed` picks one bed, whose overrides are laid over the preset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from core.config import StrictModel
from evaluation.statistics import (
    Components,
    Estimate,
    components,
    crossed_interval,
    minimum_detectable_effect,
)


class PilotBed(StrictModel):
    """One bed of the knob search: ExperimentConfig overrides laid over the pilot preset."""

    name: str = Field(description="The bed's name (`pilot_bed=NAME` runs it).")
    overrides: list[str] = Field(
        [],
        description="KEY=VALUE ExperimentConfig overrides (train.steps=240, train.grpo.lr=2e-5).",
    )
    why: str = Field("", description="The knob it turns and why it might make fresh data matter.")
    cpu_hours: float = Field(gt=0, description="Estimated CPU-hours of this pilot (2 cores).")


class Precondition(StrictModel):
    """The dose-response gate, declared before the pilot runs (module docstring)."""

    arm: str = Field(description="The 1.5x fresh-prompts arm (a variant of on_policy).")
    reference: str = Field(description="The b arm it is compared with.")
    metric: Literal["mean_at_k", "best_at_k", "greedy_em"] = "mean_at_k"
    planned_seeds: int = Field(ge=2, description="Seeds of the planned replay comparison.")
    planned_questions: int | None = Field(
        None, ge=2, description="Its held-out questions; None: as many as the pilot's."
    )
    planned_k: int = Field(ge=1, description="Its samples per question.")
    ratio: float = Field(2.0, gt=0, description="GO needs gain >= ratio x MDE.")
    beds: list[PilotBed] = Field(
        [], description="The knob grid, searched in this order (the stop rule says when to stop)."
    )
    stop_rule: str = Field(
        "Run the beds in order; stop at the first that passes the gate and run the replay"
        " comparison on it. 'No bed on this machine passes' is reported only after every"
        " declared bed ran; every pilot run and every one left unrun is reported.",
        description="When the search stops, in words.",
    )


@dataclass(frozen=True)
class PreconditionResult:
    """The gate as measured: the dose step's gain with its interval, the planned design's MDE
    from the pilot's components, and GO or NO-GO."""

    arm: str
    reference: str
    metric: str
    seeds: list[int]
    questions: int
    gain: Estimate
    mde: float
    needed: float
    """ratio x MDE: the smallest gain that says GO."""
    design: tuple[int, int, int]
    """The planned comparison's (seeds, questions, k)."""
    components: Components
    go: bool
    verdict: str
    """One line: GO / NO-GO with the numbers."""


def gate(
    gain_table: np.ndarray,
    sampling_noise: float,
    k: int,
    design: tuple[int, int, int],
    ratio: float = 2.0,
    alpha: float = 0.05,
    power: float = 0.8,
) -> tuple[Estimate, Components, float, bool]:
    """GO when the mean of `gain_table` (`[S, Q]`, arm minus reference per seed and
    question) is at least `ratio` x the MDE of `design` (seeds, questions, k) computed from
    `gain_table`'s own variance components (`sampling_noise`: its binomial part at `k`).
    Returns (the gain with its crossed interval, the components, the MDE, go)."""
    parts = components(gain_table, sampling_noise, k)
    seeds, questions, planned_k = design
    mde = minimum_detectable_effect(parts, seeds, questions, planned_k, alpha, power)
    gain = crossed_interval(gain_table, 1 - alpha)
    return gain, parts, mde, gain.estimate >= ratio * mde


def precondition_line(result_gain: Estimate, mde: float, ratio: float, go: bool, name: str) -> str:
    """The gate's verdict in one line."""
    return (
        f"{'GO' if go else 'NO-GO'}: {name} gains {result_gain.estimate:+.4f}"
        f" [{result_gain.low:+.4f}, {result_gain.high:+.4f}]; needed >= {ratio:g} x MDE"
        f" {mde:.4f} = {ratio * mde:.4f}"
    )
