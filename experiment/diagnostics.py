"""The cheap diagnostics of a candidate bed, run before its dose-response pilot (issue 49).

The pilot asks whether 1.5x the fresh prompts buys quality; it costs hours. Two screens of one
seed each say first whether it can:

- the pool-size check (`PoolCheck`): the same arm trained on the whole RL pool and on a pool
  of a few questions (`data.train_questions`), each run's gain over the SFT start paired by
  question. Where the gains match (two one-sided tests against a margin declared before the
  runs), distinct questions cannot matter on the bed, and more fresh prompts cannot buy
  anything that repeats of the same prompts would not: the bed is dropped. Where the full pool
  gains more, fresh data can matter.
- the dose screen (`DoseScreen`): a low and a high number of fresh prompts a step at equal
  updates (b = 4 against b = 16). By log-dose arithmetic, if each doubling of the prompts buys
  g = (high - low) / log2(high_dose / low_dose), the pilot's 1.5x step buys g x log2(1.5);
  the bed goes on to the pilot only where that reaches the gate's threshold.

Both are screens, not verdicts: with one seed their intervals are over questions only and
leave out how differently two training runs turn out. With two seeds or more they take the
crossed interval of `evaluation.statistics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from core.config import StrictModel
from evaluation.statistics import Equivalence, Estimate, crossed_interval, equivalence, t_estimate

Metric = Literal["mean_at_k", "best_at_k", "greedy_em"]


class PoolCheck(StrictModel):
    """The pool-size check, declared before the runs (module docstring)."""

    arm: str = Field(description="The arm trained on the whole RL pool.")
    pool_arm: str = Field(
        description="The same arm on a small pool (`data.train_questions` in its overrides)."
    )
    metric: Metric = Field("mean_at_k", description="The held-out metric of the gains.")
    margin: float = Field(
        gt=0,
        description="Declared before the runs: the gains 'match' only when two one-sided tests"
        " put their difference inside +-margin.",
    )


class DoseScreen(StrictModel):
    """The dose screen, declared before the runs (module docstring)."""

    arm: str = Field(description="The arm with the high number of fresh prompts a step.")
    reference: str = Field(description="The arm with the low number, at as many updates.")
    dose_ratio: float = Field(gt=1, description="High over low fresh prompts a step (16 / 4).")
    step: float = Field(1.5, gt=1, description="The pilot's dose step the screen projects to.")
    needed: float = Field(
        gt=0, description="What the projected step must reach: the gate's 2 x MDE (declared)."
    )
    metric: Metric = Field("mean_at_k", description="The held-out metric.")


@dataclass(frozen=True)
class PoolCheckResult:
    """The pool-size check as measured: each run's gain over the SFT start and the gains'
    difference (full pool minus small pool), with intervals and the equivalence test."""

    check: PoolCheck
    seeds: list[int]
    questions: int
    full_gain: Estimate
    pool_gain: Estimate
    difference: Estimate
    equivalence: Equivalence
    verdict: str


@dataclass(frozen=True)
class DoseScreenResult:
    """The dose screen as measured: the gain of the high dose over the low, what each doubling
    buys, what the pilot's step would buy by the log-dose arithmetic, and whether it reaches
    the threshold."""

    screen: DoseScreen
    seeds: list[int]
    questions: int
    gain: Estimate
    per_doubling: float
    projected_step: float
    projected_interval: tuple[float, float]
    needed: float
    passes: bool
    verdict: str


def paired_estimate(d: np.ndarray, level: float = 0.95) -> Estimate:
    """The mean of `d` `[S, Q]` with the crossed interval (2+ seeds) or, with one seed, the
    paired t-interval over questions (the seed-to-seed spread is not in it)."""
    d = np.asarray(d, dtype=np.float64)
    if d.shape[0] >= 2:
        return crossed_interval(d, level)
    q = d[0]
    se = float(q.std(ddof=1) / math.sqrt(len(q)))
    return t_estimate(float(q.mean()), se, len(q) - 1, level, "paired t over questions, one seed")


def pool_check(
    full: np.ndarray,
    pool: np.ndarray,
    start: np.ndarray,
    seeds: list[int],
    check: PoolCheck,
    alpha: float = 0.05,
) -> PoolCheckResult:
    """`full` and `pool` `[S, Q]`: the two arms' per-question scores of `seeds`; `start`
    `[Q]`: the SFT start's. Gains are paired by question (one start for every seed)."""
    full, pool = np.asarray(full, np.float64), np.asarray(pool, np.float64)
    start = np.asarray(start, np.float64)[None, :]
    full_gain = paired_estimate(full - start, 1 - alpha)
    pool_gain = paired_estimate(pool - start, 1 - alpha)
    difference = paired_estimate(full - pool, 1 - alpha)
    same = equivalence(difference, check.margin, alpha)
    if same.equivalent:
        verdict = (
            f"gains match within +-{check.margin:g} ({same.low:+.4f} to {same.high:+.4f}):"
            " distinct questions cannot matter on this bed; drop it"
        )
    elif difference.low > 0:
        verdict = "fresh data can matter: the whole pool gains more than the small one"
    elif difference.high < 0:
        verdict = "the small pool gains more: more distinct questions did not help"
    else:
        verdict = "inconclusive: neither a difference nor a match within the margin"
    return PoolCheckResult(
        check=check, seeds=list(seeds), questions=int(full.shape[1]),
        full_gain=full_gain, pool_gain=pool_gain, difference=difference, equivalence=same,
        verdict=verdict,
    )  # fmt: skip


def dose_screen(
    high: np.ndarray, low: np.ndarray, seeds: list[int], screen: DoseScreen, alpha: float = 0.05
) -> DoseScreenResult:
    """`high` and `low` `[S, Q]`: the two doses' per-question scores of `seeds`."""
    gain = paired_estimate(np.asarray(high) - np.asarray(low), 1 - alpha)
    doublings = math.log2(screen.dose_ratio)
    per_step = math.log2(screen.step) / doublings  # the step's share of the measured gain
    projected = gain.estimate * per_step
    passes = projected >= screen.needed
    verdict = (
        f"{'on to the pilot' if passes else 'no pilot'}: {screen.arm} − {screen.reference}"
        f" gains {gain.estimate:+.4f} [{gain.low:+.4f}, {gain.high:+.4f}], so a {screen.step:g}x"
        f" step would buy {projected:+.4f} (needed {screen.needed:.4f})"
    )
    return DoseScreenResult(
        screen=screen, seeds=list(seeds), questions=int(np.shape(high)[1]), gain=gain,
        per_doubling=gain.estimate / doublings, projected_step=projected,
        projected_interval=(gain.low * per_step, gain.high * per_step), needed=screen.needed,
        passes=passes, verdict=verdict,
    )  # fmt: skip
