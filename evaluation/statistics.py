"""The one statistics layer of paired arm comparisons over seeds x questions: intervals,
verdicts, equivalence, power.

A contrast compares two arms trained with the same seeds (same SFT start, same prompt order)
and evaluated on the same questions. Its data is `d[s, q]`, arm minus reference on question
`q` in seed `s` (a question's Mean@k fraction, Best@k 0/1 or greedy 0/1). The model is the
two-way crossed random-effects model without replication,

    d[s, q] = mu + a[s] + b[q] + e[s, q],

with seed effects `a` (variance `seed`: how differently two training runs turn out),
question effects `b` (`question`: questions where one arm is better whatever the seed) and
the residual `e` (`residual`: the seed-by-question interaction plus the sampling noise of
`k` samples). The estimate is the grand mean; its variance is

    Var(mean d) = seed / S + question / Q + residual / (S Q),

estimated from the ANOVA mean squares (method of moments) as `(MS_S + MS_Q - MS_E) / (S Q)`,
with Satterthwaite's degrees of freedom for the t quantile (`crossed_interval`). That estimate
subtracts a mean square, and when the seed mean square falls below the residual's the
Satterthwaite df collapses (1.4 on the powered comparison's first primary contrast): below
`MIN_DF` the interval falls back to a stated conservative one, the upper bound
`(MS_S + MS_Q) / (S Q)` of the variance (its expectation exceeds the true variance by
`residual / (S Q)`) at that sum's own Satterthwaite df, `(MS_S + MS_Q)^2 / (MS_S^2 / (S - 1) +
MS_Q^2 / (Q - 1))`. A sum of positive terms never has fewer df than its fewest, `min(S, Q) - 1`,
which the fallback used before: 1 df (t = 12.7) on two seeds, about six times wider than its
variance needs where the question term dominates. The price: that df is estimated from the
observed mean squares, so on two seeds, when the seed mean square comes out small by chance,
the df is large and the interval too narrow. Simulated two-seed pilots (200 questions,
`bench/probes/interval_coverage.py`) cover at 0.955 without a seed effect and at 0.92 / 0.89 / 0.87
with seed variances of 0.5% / 2% / 5% of the residual's: a 95% fallback interval on two seeds is
about a 90% one, so it screens; the gate's verdicts compare the estimate with 2 x MDE instead.

Beside it, `seed_t` is the t-interval over seeds of the per-seed mean difference; it ignores
the question term (shared question effects move every seed alike), so it is reported, not
used for verdicts. There is no bootstrap here: resampling seeds and questions independently
counts the residual about three times instead of once.

Verdicts: `verdict` (+, −, 0 by a two-sided test at alpha); "matches" only by `equivalence`,
two one-sided tests (TOST) against a margin declared in the experiment config before the runs.

Power: the minimum detectable effect (MDE) of a design (`S` seeds, `Q` questions, `k`
samples) at two-sided level `alpha` and power `power` is `(t_{1-alpha/2} + t_{power}) * SE`,
with the components measured on pilot runs; the residual's sampling-noise part (estimated
from each question's `k` samples, binomially) is rescaled to the design's `k`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class Components:
    """Variance components of a contrast's `d[s, q]` (see the module docstring).
    `sampling_noise` is the part of `residual` that `k` samples per question contribute."""

    seed: float
    question: float
    residual: float
    sampling_noise: float
    seeds: int
    questions: int
    k: int | None

    def se(self, seeds: int, questions: int, k: int | None = None) -> float:
        """The standard error of the mean difference for a design of `seeds` x `questions`
        with `k` samples per question (default: the measured `k`)."""
        residual = self.residual
        if k is not None and self.k is not None and self.sampling_noise > 0:
            residual += self.sampling_noise * (self.k / k - 1.0)
        variance = self.seed / seeds + self.question / questions + residual / (seeds * questions)
        return math.sqrt(max(variance, 0.0))


def mean_squares(d: np.ndarray) -> tuple[float, float, float]:
    """(MS_seed, MS_question, MS_residual) of a `[S, Q]` table (S, Q >= 2)."""
    S, Q = d.shape
    grand = d.mean()
    seed_means, question_means = d.mean(axis=1), d.mean(axis=0)  # (S,), (Q,)
    ms_seed = Q * float(((seed_means - grand) ** 2).sum()) / (S - 1)
    ms_question = S * float(((question_means - grand) ** 2).sum()) / (Q - 1)
    resid = d - seed_means[:, None] - question_means[None, :] + grand  # (S, Q)
    ms_residual = float((resid**2).sum()) / ((S - 1) * (Q - 1))
    return ms_seed, ms_question, ms_residual


def components(d: np.ndarray, sampling_noise: float = 0.0, k: int | None = None) -> Components:
    """Method-of-moments variance components of `d` `[S, Q]` (S >= 2 seeds, Q >= 2
    questions; negative estimates are set to 0, as usual)."""
    d = np.asarray(d, dtype=np.float64)
    S, Q = d.shape
    if S < 2 or Q < 2:
        raise ValueError(f"variance components need 2+ seeds and 2+ questions, got {d.shape}")
    ms_seed, ms_question, ms_residual = mean_squares(d)
    return Components(
        seed=max(0.0, (ms_seed - ms_residual) / Q),
        question=max(0.0, (ms_question - ms_residual) / S),
        residual=ms_residual,
        sampling_noise=min(sampling_noise, ms_residual),
        seeds=S,
        questions=Q,
        k=k,
    )


def binomial_noise(correct: np.ndarray) -> float:
    """The variance `k` samples per question add to one run's Mean@k of a question, averaged
    over seeds and questions: `p (1 - p) / (k - 1)`, the unbiased binomial variance of a mean
    of `k`. `[..., k]` 0/1 (0 with one sample: nothing to estimate it from)."""
    c = np.asarray(correct, dtype=np.float64)
    k = c.shape[-1]
    if k < 2:
        return 0.0
    p = c.mean(axis=-1)
    return float((p * (1 - p) / (k - 1)).mean())


def sampling_noise(correct_a: np.ndarray, correct_b: np.ndarray) -> float:
    """The sampling noise of a Mean@k difference: both arms' `binomial_noise` (`[S, Q, k]`)."""
    return binomial_noise(correct_a) + binomial_noise(correct_b)


@dataclass(frozen=True)
class Estimate:
    """A contrast's mean difference with its interval, p-value and how they were made."""

    estimate: float
    low: float
    high: float
    se: float
    df: float
    p: float
    level: float
    method: str


MIN_DF = 3.0
"""Below this Satterthwaite df the crossed interval uses its conservative fallback."""


def crossed_interval(d: np.ndarray, level: float = 0.95, min_df: float = MIN_DF) -> Estimate:
    """The grand mean of `d` `[S, Q]` with the crossed random-effects interval (module
    docstring): SE^2 = (MS_S + MS_Q - MS_E) / (S Q), Satterthwaite's df, a two-sided t-test's
    p-value. When that df is below `min_df`: SE^2 = (MS_S + MS_Q) / (S Q) at its own
    Satterthwaite df (conservative; `method` says so)."""
    d = np.asarray(d, dtype=np.float64)
    S, Q = d.shape
    if S < 2 or Q < 2:
        raise ValueError(f"a crossed interval needs 2+ seeds and 2+ questions, got {d.shape}")
    mean = float(d.mean())
    ms_seed, ms_question, ms_residual = mean_squares(d)
    variance = max((ms_seed + ms_question - ms_residual) / (S * Q), 1e-300)
    df = satterthwaite(
        variance * S * Q,
        [(ms_seed, S - 1), (ms_question, Q - 1), (-ms_residual, (S - 1) * (Q - 1))],
    )
    method = "crossed random effects"
    if df < min_df:
        variance = max((ms_seed + ms_question) / (S * Q), 1e-300)
        df = satterthwaite(variance * S * Q, [(ms_seed, S - 1), (ms_question, Q - 1)])
        method = f"crossed random effects, conservative (Satterthwaite df < {min_df:g})"
    return t_estimate(mean, math.sqrt(variance), df, level, method)


def satterthwaite(total: float, terms: Sequence[tuple[float, int]]) -> float:
    """Satterthwaite's df of `total = sum(ms)` over `(ms, dof)` terms: `total^2 / sum(ms^2 /
    dof)`, kept within [1, sum of dof]."""
    most = sum(dof for _, dof in terms)
    spread = sum(ms**2 / dof for ms, dof in terms if dof > 0)
    if spread == 0:  # every mean square 0 (a constant table): nothing to lose df to
        return float(most)
    return float(min(max(total**2 / spread, 1.0), most))


def t_estimate(mean: float, se: float, df: float, level: float, method: str) -> Estimate:
    """`mean +- t_{(1+level)/2, df} * se` with the two-sided p-value of mean = 0."""
    half = float(stats.t.ppf((1 + level) / 2, df)) * se
    p = float(2 * stats.t.sf(abs(mean) / se, df)) if se > 0 else (0.0 if mean else 1.0)
    return Estimate(mean, mean - half, mean + half, se, df, p, level, method)


def seed_t(d: np.ndarray, level: float = 0.95) -> Estimate:
    """The t-interval over seeds of the per-seed mean difference (the seed is the unit)."""
    per_seed = np.asarray(d, dtype=np.float64).mean(axis=1)
    interval = mean_interval(per_seed, level)
    S, mean, se = len(per_seed), interval.estimate, interval.se
    p = float(2 * stats.t.sf(abs(mean) / se, S - 1)) if se > 0 else (0.0 if mean else 1.0)
    return replace(interval, p=p)


def mean_interval(values: Sequence[float], level: float = 0.95) -> Estimate:
    """The mean of independent values (one per seed) with its t-interval (NaN bounds with
    fewer than two values)."""
    v = np.asarray(values, dtype=np.float64)
    mean = float(v.mean())
    if len(v) < 2:
        return Estimate(mean, math.nan, math.nan, math.nan, 0, math.nan, level, "seed t")
    se = float(v.std(ddof=1) / math.sqrt(len(v)))
    half = float(stats.t.ppf((1 + level) / 2, len(v) - 1)) * se
    return Estimate(mean, mean - half, mean + half, se, len(v) - 1, math.nan, level, "seed t")


def minimum_detectable_effect(
    parts: Components,
    seeds: int,
    questions: int,
    k: int | None = None,
    alpha: float = 0.05,
    power: float = 0.8,
) -> float:
    """The smallest true difference a two-sided test at `alpha` finds with probability
    `power` in a design of `seeds` x `questions` x `k`: `(t_{1-alpha/2} + t_power) * SE`,
    with the t quantiles at `seeds - 1` degrees of freedom (the seed term's, the smallest
    the design has: conservative)."""
    se = parts.se(seeds, questions, k)
    df = max(seeds - 1, 1)
    return float((stats.t.ppf(1 - alpha / 2, df) + stats.t.ppf(power, df)) * se)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error), in the input order."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def greater(estimate: Estimate) -> Estimate:
    """The one-sided test of H0: difference <= 0 on the estimate's own SE and df (p =
    P(T_df > mean / se)); the interval stays the two-sided one it was made with."""
    mean, se = estimate.estimate, estimate.se
    p = float(stats.t.sf(mean / se, estimate.df)) if se > 0 else (0.0 if mean > 0 else 1.0)
    return replace(estimate, p=p, method=f"{estimate.method}, one-sided (greater)")


def verdict(estimate: Estimate, alpha: float = 0.05, p: float | None = None) -> str:
    """ "+" or "−" when the difference is significant at `alpha` (`p`: an adjusted p-value
    in place of the estimate's own), "0" when it is not (no difference shown: not "equal",
    which only `equivalence` can say)."""
    if (estimate.p if p is None else p) >= alpha:
        return "0"
    return "+" if estimate.estimate > 0 else "−"


@dataclass(frozen=True)
class Equivalence:
    """Two one-sided tests (TOST) of `|true difference| < margin`: `p_lower` tests
    H0: diff <= -margin, `p_upper` H0: diff >= +margin; `p` is the larger. `equivalent` when
    `p < alpha`, the same as the `1 - 2 alpha` interval [`low`, `high`] lying inside
    (-margin, +margin)."""

    margin: float
    p_lower: float
    p_upper: float
    p: float
    low: float
    high: float
    alpha: float
    equivalent: bool


def equivalence(estimate: Estimate, margin: float, alpha: float = 0.05) -> Equivalence:
    """TOST on an estimate's own SE and df (the crossed interval's, its conservative fallback
    included): with t_lo = (mean + margin) / se and t_hi = (mean - margin) / se,
    p_lower = P(T_df > t_lo), p_upper = P(T_df < t_hi)."""
    if margin <= 0:
        raise ValueError(f"an equivalence margin must be positive, not {margin}")
    mean, se, df = estimate.estimate, estimate.se, estimate.df
    if se > 0:
        p_lower = float(stats.t.sf((mean + margin) / se, df))
        p_upper = float(stats.t.cdf((mean - margin) / se, df))
        half = float(stats.t.ppf(1 - alpha, df)) * se
    else:  # no spread at all: the point decides
        p_lower = 0.0 if mean > -margin else 1.0
        p_upper = 0.0 if mean < margin else 1.0
        half = 0.0
    p = max(p_lower, p_upper)
    return Equivalence(margin, p_lower, p_upper, p, mean - half, mean + half, alpha, p < alpha)


def at_budgets(costs: Sequence[float], quality: Sequence[float], budgets: Sequence[float]):
    """A run's quality at each budget, linearly interpolated on its (cumulative cost,
    held-out quality) curve; NaN past either end of the curve (no extrapolation)."""
    x = np.asarray(costs, dtype=np.float64)
    y = np.asarray(quality, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    return np.interp(budgets, x, y, left=math.nan, right=math.nan)
