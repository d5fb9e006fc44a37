"""The experiment's typed summary: per-arm quality and costs over seeds, paired comparisons
with the reference arms, and the record of the run that `results.json` is written from.

Every section is a dataclass whose field names are the JSON keys (`write_json_atomic` writes
them as they are), so a new section of results (pre-declared contrasts, power, quality at
matched cost) is one more dataclass and one more field of `ExperimentSummary`, filled in
`summarize` and drawn by `experiment.report`.
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from core.errors import UserError
from evaluation.costs import ModelledCostRow, billed_searches, matched_modelled_cost
from evaluation.metrics import PairedDifference, Spread, mean_spread, paired_difference
from evaluation.statistics import (
    Components,
    Equivalence,
    Estimate,
    at_budgets,
    components,
    crossed_interval,
    equivalence,
    greater,
    holm,
    mean_interval,
    minimum_detectable_effect,
    sampling_noise,
    seed_t,
    verdict,
)
from experiment.config import ExperimentConfig
from experiment.diagnostics import DoseScreenResult, PoolCheckResult, dose_screen, pool_check
from experiment.mechanism import MechanismSummary, summarize_mechanism
from experiment.precondition import PreconditionResult, gate, precondition_line
from trainer.telemetry import cost_totals

if TYPE_CHECKING:
    from evaluation.evaluate import EvalReport
    from experiment.runs import RunResult

# The held-out metrics: the summary's name and `EvalReport.per_question`'s name of each.
QUALITY_METRICS = (("mean_at_k", "mean"), ("best_at_k", "best"), ("greedy_em", "greedy"))
TIME_KEYS = ("time_generation", "time_retrieval", "time_scoring", "time_selection", "time_update")
CPU_KEYS = ("cost_cpu_rollout_s", "cost_cpu_scoring_s", "cost_cpu_selection_s", "cost_cpu_update_s")
TF_KEYS = ("cost_behaviour_tf_tokens", "cost_scan_tf_tokens", "cost_update_tf_tokens")

T = TypeVar("T")


@dataclass(frozen=True)
class ByMetric(Generic[T]):
    """One value for each held-out metric (`QUALITY_METRICS`)."""

    mean_at_k: T
    best_at_k: T
    greedy_em: T

    @classmethod
    def build(cls, value: Callable[[str, str], T]) -> ByMetric[T]:
        """`value(metric, per_question_name)` for each metric."""
        return cls(*(value(metric, short) for metric, short in QUALITY_METRICS))

    def items(self) -> list[tuple[str, T]]:
        return [(metric, getattr(self, metric)) for metric, _ in QUALITY_METRICS]


@dataclass(frozen=True)
class SeedComparison:
    """One metric of an arm against a reference, over the seeds both ran: the crossed
    random-effects interval over seeds x questions (`evaluation.statistics.crossed_interval`,
    with its conservative fallback) and, beside it, the t-interval over seeds (95%). With one
    common seed neither exists (None)."""

    seeds: list[int]
    crossed: Estimate | None
    seed_t: Estimate | None

    @property
    def verdict(self) -> str:
        """+, − or 0 by the crossed interval's two-sided test at 0.05, n/a with one seed."""
        return "n/a" if self.crossed is None else verdict(self.crossed)


@dataclass(frozen=True)
class ArmSummary:
    """One arm over its seeds. `diffs` and `seed_stats` are keyed by reference arm."""

    seeds: list[int]
    run_dirs: list[str]
    per_seed: ByMetric[list[float]]
    """Each seed's held-out score, in `seeds` order."""
    costs_per_seed: list[dict[str, float]]
    """`run_costs` of each seed's run."""
    diffs: dict[str, ByMetric[PairedDifference]]
    """Paired on the same questions, per-question scores averaged over seeds first."""
    seed_stats: dict[str, ByMetric[SeedComparison]]
    mean_at_k: Spread
    best_at_k: Spread
    greedy_em: Spread
    costs: dict[str, Spread]
    """Each `run_costs` total over the seeds."""

    def quality(self) -> ByMetric[Spread]:
        return ByMetric(self.mean_at_k, self.best_at_k, self.greedy_em)


@dataclass(frozen=True)
class ContrastResult:
    """A declared contrast (`ExperimentConfig.contrasts`) as measured: arm minus reference on
    the metric, paired by seed and question (`evaluation.statistics`)."""

    arm: str
    reference: str
    metric: str
    primary: bool
    seeds: list[int]
    questions: int
    estimate: float
    low: float
    high: float
    method: str
    p: float
    p_holm: float | None
    """Holm-adjusted over the non-primary contrasts (None for a primary one)."""
    mde: float
    """The minimum detectable effect of this design (its seeds, questions, k) at the
    experiment's alpha and power, from the variance components it measured."""
    verdict: str
    """+ / − / 0: significant at alpha (primary: own p; others: Holm-adjusted p)."""
    seed_t: Estimate
    """The t-interval over seeds of the per-seed difference, beside the primary interval."""
    components: Components
    equivalence: Equivalence | None = None
    """TOST against the contrast's `equivalence_margin`, declared before the runs (None when
    it declares none: then the contrast can never be said to "match")."""


@dataclass(frozen=True)
class BudgetRow:
    """Quality at one matched budget on one cost axis: each seed's value read off its run's
    in-training curve (linear interpolation), their mean and t-interval over seeds. With a
    `reference`, the row is a declared contrast's difference, arm minus reference, seed by
    seed (same seed: same prompts and the same in-training questions)."""

    axis: str
    budget: float
    arm: str
    metric: str
    per_seed: list[float]
    estimate: float
    low: float
    high: float
    reference: str | None = None
    seeds: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ExperimentSummary:
    """The statistics: every arm, on `num_questions` held-out questions with k samples."""

    arms: dict[str, ArmSummary]
    num_questions: int
    k: int | None
    sft_start: ByMetric[float] | None = None
    """The shared SFT start's held-out scores, the row every arm started from."""
    rise: dict[str, ByMetric[PairedDifference]] = field(default_factory=dict)
    """Per arm, its score minus the SFT start's on the same questions (empty without the
    start's evaluation): how far RL moved the policy, beside the sampling noise of both."""
    contrasts: list[ContrastResult] = field(default_factory=list)
    """The declared contrasts, primary ones first."""
    matched_cost: list[BudgetRow] = field(default_factory=list)
    """Quality at equal budgets of generated tokens, env requests, CPU and wall seconds."""
    modelled_cost: list[ModelledCostRow] = field(default_factory=list)
    """Quality at matched modelled cost for each env-to-compute ratio (evaluation/costs.py)."""
    precondition: PreconditionResult | None = None
    """The dose-response gate, when the config declares one: GO / NO-GO with its numbers."""
    pool_check: PoolCheckResult | None = None
    """The pool-size check, when the config declares one: both gains and their difference."""
    dose_screen: DoseScreenResult | None = None
    """The dose screen, when the config declares one: the projected 1.5x step."""
    mechanism: MechanismSummary | None = None
    """The paper's mechanism views of the replaying arms (experiment/mechanism.py)."""


@dataclass(frozen=True)
class MachineInfo:
    platform: str
    python: str
    cpu_count: int | None
    torch: str
    torch_threads: int
    processor: str


def machine_info() -> MachineInfo:
    import torch

    return MachineInfo(
        platform=platform.platform(),
        python=platform.python_version(),
        cpu_count=os.cpu_count(),
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        processor=platform.processor() or platform.machine(),
    )


@dataclass(frozen=True, kw_only=True)
class ExperimentResults(ExperimentSummary):
    """`results.json`: the summary and the run that produced it."""

    server: dict[str, Any]
    """The retrieval server's /health at the end (emulated cost totals included)."""
    config: ExperimentConfig
    machine: MachineInfo
    total_wall_time: float
    sft_dir: str
    server_url: str
    """Where the server listened (stopped by the time the file is written)."""
    charts: list[str]
    """Chart paths relative to the out dir."""


# ------------------------------------------------------------------------------ costs


def run_costs(metrics: list[dict[str, Any]], rollouts_per_step: int) -> dict[str, float]:
    """Totals of one run from its metrics.jsonl rows. `rollouts`: fresh episodes with the
    environment (steps x b x G); `search_calls`: search tool calls sent to the retrieval
    server; `env_calls`: the batched HTTP requests that carried them (one per search turn)."""
    if not metrics:
        raise UserError("a run has no metrics.jsonl rows")
    last = metrics[-1]

    def total(key: str) -> float:
        return float(sum(r.get(key) or 0.0 for r in metrics))

    out = {
        "steps": len(metrics),
        "rollouts": float(len(metrics) * rollouts_per_step),
        "env_calls": float(last.get("env_calls_total") or total("env_calls")),
        "search_calls": float(last.get("search_calls_total") or total("search_calls")),
        "wall_time": float(last.get("wall_time_total") or total("time_step")),
        "step_time_mean": total("time_step") / len(metrics),
        "fresh_tokens": total("fresh_tokens"),
        "replay_tokens": total("replay_tokens"),
        "replayed_groups": total("replayed_groups"),
    }
    out.update(cost_totals(metrics))
    # a run logged before the ledger's split billed every search call
    out["cost_billed_search_calls"] = sum(billed_searches(r) for r in metrics)
    out["cost_cpu_s"] = sum(out[k] for k in CPU_KEYS)
    out["cost_tf_tokens"] = sum(out[k] for k in TF_KEYS)
    for key in TIME_KEYS:
        out[key] = total(key)
    out["time_other"] = max(0.0, total("time_step") - sum(out[k] for k in TIME_KEYS))
    rates = [r["acceptance_rate"] for r in metrics if _is_finite_number(r.get("acceptance_rate"))]
    out["acceptance_rate_mean"] = float(np.mean(rates)) if rates else math.nan
    return out


def _is_finite_number(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


# ------------------------------------------------------------------------- statistics


def per_question_scores(runs: list[RunResult], metric: str) -> np.ndarray:
    """`[S, Q]`: each run's per-question score (`EvalReport.per_question` name), by seed."""
    return np.stack([r.report.per_question(metric) for r in sorted(runs, key=lambda x: x.seed)])


def paired_differences(runs: list[RunResult], refs: list[RunResult]) -> ByMetric[PairedDifference]:
    """Per metric, `runs` - `refs` on the same questions, per-question scores averaged over
    seeds first (`paired_difference`)."""
    return ByMetric.build(
        lambda _, short: paired_difference(
            per_question_scores(runs, short), per_question_scores(refs, short)
        )
    )


def rise_over_start(
    arms: dict[str, list[RunResult]], sft_report: EvalReport
) -> dict[str, ByMetric[PairedDifference]]:
    """Per arm, its per-question scores (averaged over seeds) minus the SFT start's."""
    return {
        name: ByMetric.build(
            lambda _, short, runs=runs: paired_difference(
                per_question_scores(runs, short), sft_report.per_question(short)
            )
        )
        for name, runs in arms.items()
    }


def seed_statistics(runs: list[RunResult], refs: list[RunResult]) -> ByMetric[SeedComparison]:
    """Per metric, over the seeds both arms ran: the crossed interval of the paired
    per-question difference and the t-interval over seeds (95%)."""
    mine, theirs = {r.seed: r for r in runs}, {r.seed: r for r in refs}
    seeds = sorted(set(mine) & set(theirs))

    def compare(metric: str, short: str) -> SeedComparison:
        a = np.stack([mine[s].report.per_question(short) for s in seeds])  # (S, Q)
        b = np.stack([theirs[s].report.per_question(short) for s in seeds])  # (S, Q)
        if len(seeds) < 2 or a.shape[1] < 2:
            return SeedComparison(seeds, None, None)
        return SeedComparison(seeds, crossed_interval(a - b), seed_t(a - b))

    return ByMetric.build(compare)


def summarize_arm(
    runs: list[RunResult],
    arms: dict[str, list[RunResult]],
    references: Sequence[str],
) -> ArmSummary:
    """One arm's runs (sorted by seed) over seeds, compared with each reference arm it has
    not already been compared with the other way round."""
    name = runs[0].arm
    costs = [run_costs(r.metrics, r.rollouts_per_step) for r in runs]
    per_seed = ByMetric.build(lambda metric, _: [r.report.average[metric] for r in runs])
    diffs, seed_stats = {}, {}
    for ref in references:
        if ref == name or ref not in arms or name in references[: references.index(ref)]:
            continue  # itself, absent, or already shown as `name` vs `ref` the other way
        diffs[ref] = paired_differences(runs, arms[ref])
        seed_stats[ref] = seed_statistics(runs, arms[ref])
    return ArmSummary(
        seeds=[r.seed for r in runs],
        run_dirs=[str(r.run_dir) for r in runs],
        per_seed=per_seed,
        costs_per_seed=costs,
        diffs=diffs,
        seed_stats=seed_stats,
        mean_at_k=mean_spread(per_seed.mean_at_k),
        best_at_k=mean_spread(per_seed.best_at_k),
        greedy_em=mean_spread(per_seed.greedy_em),
        costs={key: mean_spread([c[key] for c in costs]) for key in costs[0]},
    )


def contrast_results(
    arms: dict[str, list[RunResult]], cfg: ExperimentConfig
) -> list[ContrastResult]:
    """Every declared contrast over the seeds both arms ran, primary ones first: the crossed
    random-effects interval, its p-value (Holm-adjusted across the non-primary ones), the
    design's MDE and the verdict (`evaluation.statistics`)."""
    measured = []
    for c in sorted(cfg.contrasts, key=lambda c: not c.primary):
        mine = {r.seed: r for r in arms.get(c.arm, [])}
        theirs = {r.seed: r for r in arms.get(c.reference, [])}
        seeds = sorted(set(mine) & set(theirs))
        if len(seeds) < 2:
            continue  # an interval needs two seeds at least
        short = dict(QUALITY_METRICS)[c.metric]
        a = np.stack([mine[s].report.per_question(short) for s in seeds])  # (S, Q)
        b = np.stack([theirs[s].report.per_question(short) for s in seeds])  # (S, Q)
        noise = 0.0
        if c.metric == "mean_at_k":
            noise = sampling_noise(
                np.stack([correct_samples(mine[s].report) for s in seeds]),
                np.stack([correct_samples(theirs[s].report) for s in seeds]),
            )
        k = mine[seeds[0]].report.k
        parts = components(a - b, noise, k)
        est = crossed_interval(a - b, 1 - cfg.alpha)
        if c.alternative == "greater":
            est = greater(est)
        measured.append((c, seeds, est, seed_t(a - b), parts))
    secondary = [i for i, (c, *_) in enumerate(measured) if not c.primary]
    adjusted = dict(zip(secondary, holm([measured[i][2].p for i in secondary]), strict=True))
    out = []
    for i, (c, seeds, est, by_seed, parts) in enumerate(measured):
        p_holm = adjusted.get(i)
        out.append(
            ContrastResult(
                arm=c.arm,
                reference=c.reference,
                metric=c.metric,
                primary=c.primary,
                seeds=seeds,
                questions=parts.questions,
                estimate=est.estimate,
                low=est.low,
                high=est.high,
                method=est.method,
                p=est.p,
                p_holm=p_holm,
                mde=minimum_detectable_effect(
                    parts, len(seeds), parts.questions, parts.k, cfg.alpha, cfg.power
                ),
                verdict=verdict(est, cfg.alpha, p_holm),
                seed_t=by_seed,
                components=parts,
                equivalence=(
                    equivalence(est, c.equivalence_margin, cfg.alpha)
                    if c.equivalence_margin is not None
                    else None
                ),
            )
        )
    return out


def correct_samples(report: EvalReport) -> np.ndarray:
    """`[Q, k]` 0/1: which of each question's k samples were correct, all datasets."""
    return np.concatenate([np.asarray(d.correct, dtype=np.float64) for d in report.datasets])


COST_AXES_MATCHED = ("generated_tokens", "env_requests", "cpu_seconds", "wall_seconds")


def matched_cost(
    arms: dict[str, list[RunResult]], cfg: ExperimentConfig, metric: str = "mean_at_k"
) -> list[BudgetRow]:
    """Quality at equal budgets: on each cost axis, budgets at `cfg.budget_fractions` of the
    smallest total any arm reached; each run's in-training held-out `metric` read off its
    (cumulative cost, quality) curve at each budget, then mean and t-interval over seeds, for
    every arm and for every declared contrast on `metric` (arm minus reference, by seed)."""
    from evaluation.plots import read_jsonl, with_cumulative_cost

    curves = {
        name: {
            r.seed: with_cumulative_cost(r.metrics, read_jsonl(r.run_dir / "eval.jsonl"))
            for r in runs
            if (r.run_dir / "eval.jsonl").is_file()
        }
        for name, runs in arms.items()
    }  # arm -> seed -> the run's eval rows with cumulative costs
    curves = {
        name: c for name, c in curves.items() if c and all(len(run) > 1 for run in c.values())
    }
    if not curves:
        return []  # no run evaluated during training: no curve to read budgets off
    rows: list[BudgetRow] = []
    for axis in COST_AXES_MATCHED:
        reached = min(run[-1][f"cum_{axis}"] for seeds in curves.values() for run in seeds.values())
        for budget in (fraction * reached for fraction in cfg.budget_fractions):
            at = {
                (name, seed): quality_at(run, axis, metric, budget)
                for name, seeds in curves.items()
                for seed, run in seeds.items()
            }
            for name, seeds in curves.items():
                common = sorted(seeds)
                values = [at[name, s] for s in common]
                rows.append(budget_row(axis, budget, name, None, metric, values, common))
            for c in cfg.contrasts:
                if c.metric != metric or c.arm not in curves or c.reference not in curves:
                    continue
                common = sorted(set(curves[c.arm]) & set(curves[c.reference]))
                values = [at[c.arm, s] - at[c.reference, s] for s in common]
                if len(common) >= 2:
                    rows.append(
                        budget_row(axis, budget, c.arm, c.reference, metric, values, common)
                    )
    return rows


def quality_at(run: list[dict[str, Any]], axis: str, metric: str, budget: float) -> float:
    """One run's `metric` at `budget` on `axis`, from its eval rows with cumulative costs."""
    costs, quality = [r[f"cum_{axis}"] for r in run], [r[metric] for r in run]
    return float(at_budgets(costs, quality, [budget])[0])


def budget_row(
    axis: str,
    budget: float,
    arm: str,
    reference: str | None,
    metric: str,
    values: list[float],
    seeds: list[int],
) -> BudgetRow:
    interval = mean_interval(values)
    return BudgetRow(
        axis, budget, arm, metric, values, interval.estimate, interval.low, interval.high,
        reference, seeds,
    )  # fmt: skip


def summarize(
    results: list[RunResult],
    references: Sequence[str],
    sft_report: EvalReport | None = None,
    cfg: ExperimentConfig | None = None,
) -> ExperimentSummary:
    """Per arm: held-out scores and costs over seeds, paired differences to the references.
    Every run must have been evaluated on the same questions."""
    arms: dict[str, list[RunResult]] = {}
    for r in results:
        arms.setdefault(r.arm, []).append(r)
    for runs in arms.values():
        runs.sort(key=lambda x: x.seed)
    ids = None
    for r in results:
        q = r.report.question_ids()
        if ids is None:
            ids = q
        elif q != ids:
            raise UserError(f"{r.run_dir}: evaluated on other questions than the other runs")
    return ExperimentSummary(
        arms={name: summarize_arm(runs, arms, references) for name, runs in arms.items()},
        num_questions=len(ids or []),
        k=results[0].report.k if results else None,
        sft_start=(
            ByMetric.build(lambda metric, _: sft_report.average[metric])
            if sft_report is not None
            else None
        ),
        rise=rise_over_start(arms, sft_report) if sft_report is not None else {},
        contrasts=contrast_results(arms, cfg) if cfg is not None else [],
        matched_cost=matched_cost(arms, cfg) if cfg is not None and cfg.contrasts else [],
        modelled_cost=modelled_cost(arms, cfg) if cfg is not None and cfg.contrasts else [],
        precondition=precondition_result(arms, cfg) if cfg is not None else None,
        pool_check=pool_check_result(arms, sft_report, cfg) if cfg is not None else None,
        dose_screen=dose_screen_result(arms, cfg) if cfg is not None else None,
        mechanism=summarize_mechanism(arms, entropy_arms(cfg)) if cfg is not None else None,
    )


def entropy_arms(cfg: ExperimentConfig) -> tuple[str, ...]:
    """The arms whose entropy is compared at matched training score: the decision rule's
    replay arm and 1.5x-fresh arm."""
    return () if cfg.decision is None else (cfg.decision.replay, cfg.decision.larger)


def paired_tables(
    arms: dict[str, list[RunResult]], arm: str, reference: str, metric: str
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Both arms' per-question scores `[S, Q]` on the seeds both ran, and those seeds."""
    mine = {r.seed: r for r in arms.get(arm, [])}
    theirs = {r.seed: r for r in arms.get(reference, [])}
    seeds = sorted(set(mine) & set(theirs))
    if not seeds:
        return np.empty((0, 0)), np.empty((0, 0)), []
    short = dict(QUALITY_METRICS)[metric]
    a = np.stack([mine[s].report.per_question(short) for s in seeds])  # (S, Q)
    b = np.stack([theirs[s].report.per_question(short) for s in seeds])  # (S, Q)
    return a, b, seeds


def pool_check_result(
    arms: dict[str, list[RunResult]], sft_report: EvalReport | None, cfg: ExperimentConfig
) -> PoolCheckResult | None:
    """The declared pool-size check over the seeds both arms ran (None without a declared
    check, a common seed or the SFT start's evaluation, which the gains are measured from)."""
    check = cfg.pool_check
    if check is None or sft_report is None:
        return None
    full, pool, seeds = paired_tables(arms, check.arm, check.pool_arm, check.metric)
    if not seeds:
        return None
    start = sft_report.per_question(dict(QUALITY_METRICS)[check.metric])
    return pool_check(full, pool, start, seeds, check, cfg.alpha)


def dose_screen_result(
    arms: dict[str, list[RunResult]], cfg: ExperimentConfig
) -> DoseScreenResult | None:
    """The declared dose screen over the seeds both doses ran (None without one)."""
    screen = cfg.dose_screen
    if screen is None:
        return None
    high, low, seeds = paired_tables(arms, screen.arm, screen.reference, screen.metric)
    return dose_screen(high, low, seeds, screen, cfg.alpha) if seeds else None


def precondition_result(
    arms: dict[str, list[RunResult]], cfg: ExperimentConfig
) -> PreconditionResult | None:
    """The declared precondition's gate (`precondition.gate`) over the seeds both of its arms
    ran; None without a declared precondition or with fewer than two common seeds."""
    pre = cfg.precondition
    if pre is None:
        return None
    a, b, seeds = paired_tables(arms, pre.arm, pre.reference, pre.metric)
    if len(seeds) < 2:
        return None
    mine = {r.seed: r for r in arms[pre.arm]}
    theirs = {r.seed: r for r in arms[pre.reference]}
    noise = 0.0
    if pre.metric == "mean_at_k":
        noise = sampling_noise(
            np.stack([correct_samples(mine[s].report) for s in seeds]),
            np.stack([correct_samples(theirs[s].report) for s in seeds]),
        )
    k = mine[seeds[0]].report.k
    design = (pre.planned_seeds, pre.planned_questions or a.shape[1], pre.planned_k)
    gain, parts, mde, go = gate(a - b, noise, k, design, pre.ratio, cfg.alpha, cfg.power)
    name = f"{pre.arm} − {pre.reference} ({pre.metric})"
    return PreconditionResult(
        arm=pre.arm, reference=pre.reference, metric=pre.metric, seeds=seeds,
        questions=int(a.shape[1]), gain=gain, mde=mde, needed=pre.ratio * mde, design=design,
        components=parts, go=go, verdict=precondition_line(gain, mde, pre.ratio, go, name),
    )  # fmt: skip


def modelled_cost(arms: dict[str, list[RunResult]], cfg: ExperimentConfig) -> list[ModelledCostRow]:
    """`matched_modelled_cost` over the runs' metrics and in-training evaluations, for the
    declared contrasts on Mean@k, at `cfg.env_ratios` and `cfg.budget_fractions`."""
    from evaluation.plots import read_jsonl

    curves = {
        name: {
            r.seed: (r.metrics, read_jsonl(r.run_dir / "eval.jsonl"))
            for r in runs
            if (r.run_dir / "eval.jsonl").is_file()
        }
        for name, runs in arms.items()
    }
    pairs = [(c.arm, c.reference) for c in cfg.contrasts if c.metric == "mean_at_k"]
    return matched_modelled_cost(
        curves, pairs, cfg.cost_model, cfg.env_ratios, cfg.budget_fractions
    )
