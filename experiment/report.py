"""`results.md`: the experiment's summary as Markdown tables (the tables of docs/results.md):
held-out quality, paired differences with their verdicts, the cost ledger and the times."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from evaluation.costs import modelled_cost_markdown
from evaluation.metrics import PairedDifference, Spread, markdown_table
from evaluation.statistics import Equivalence, Estimate, minimum_detectable_effect, t_estimate
from experiment.config import ExperimentConfig
from experiment.decision import decision_lines
from experiment.mechanism import mechanism_lines
from experiment.summary import CPU_KEYS, TIME_KEYS, BudgetRow, ExperimentSummary

SFT_START = "sft_start"


def format_spread(spread: Spread, digits: int = 3) -> str:
    """`mean ± std` over seeds; the mean alone with one seed."""
    if spread.n == 1:
        return f"{spread.mean:.{digits}f}"
    return f"{spread.mean:.{digits}f} ± {spread.std:.{digits}f}"


def format_interval(interval: Estimate | None) -> str:
    """`+mean [+low, +high]`; n/a when there is no interval (one seed)."""
    if interval is None or math.isnan(interval.low):
        return "n/a"
    return f"{interval.estimate:+.3f} [{interval.low:+.3f}, {interval.high:+.3f}]"


def diagnostics_lines(summary: ExperimentSummary) -> list[str]:
    """The bed's declared diagnostics, one paragraph each (none when not declared)."""
    lines = []
    if summary.pool_check is not None:
        pc = summary.pool_check
        lines.append(
            f"**Pool-size check (declared before the runs): {pc.verdict}.** Gain over the SFT"
            f" start, {pc.check.metric}: {pc.check.arm} {format_interval(pc.full_gain)},"
            f" {pc.check.pool_arm}"
            f" {format_interval(pc.pool_gain)}; difference {format_interval(pc.difference)}"
            f" ({pc.difference.method}; {len(pc.seeds)} seed(s) x {pc.questions} questions;"
            f" TOST at +-{pc.equivalence.margin:g}: p = {pc.equivalence.p:.3f}).\n"
        )
    if summary.dose_screen is not None:
        ds = summary.dose_screen
        low, high = ds.projected_interval
        lines.append(
            f"**Dose screen (declared before the runs): {ds.verdict}** (per doubling"
            f" {ds.per_doubling:+.4f}; the projected step's interval [{low:+.4f}, {high:+.4f}];"
            f" {ds.gain.method}, {len(ds.seeds)} seed(s) x {ds.questions} questions).\n"
        )
    return lines


def format_seed_t(interval: Estimate | None) -> str:
    if interval is None or math.isnan(interval.low):
        return "seed t n/a"
    return f"seed t [{interval.low:+.3f}, {interval.high:+.3f}]"


def results_markdown(
    summary: ExperimentSummary, cfg: ExperimentConfig, charts: Sequence[Path] | None = None
) -> str:
    """The three tables of docs/results.md: held-out quality, paired differences, cost; then
    links to `charts` (paths under the out dir's charts/)."""
    k = summary.k
    lines = []
    if summary.precondition is not None:
        pre = summary.precondition
        seeds, questions, k_planned = pre.design
        lines.append(
            f"**Precondition (declared before the runs): {pre.verdict}** (the 1.5x fresh step,"
            f" paired over {len(pre.seeds)} seeds x {pre.questions} questions; MDE of the"
            f" planned comparison at {seeds} seeds x {questions} questions x k={k_planned},"
            " from this pilot's variance components). Replay arms are compared only on a bed"
            " that says GO.\n"
        )
    lines += diagnostics_lines(summary)
    if cfg.decision is not None:
        lines += decision_lines(cfg.decision, summary.contrasts, len(cfg.seeds))
    lines += [*contrast_tables(summary, cfg), *interim_lines(summary, cfg)]
    lines += matched_cost_tables(summary)
    if summary.mechanism is not None:
        lines += mechanism_lines(summary.mechanism)
    if summary.modelled_cost:
        lines.append("\n" + modelled_cost_markdown(summary.modelled_cost, cfg.cost_model))
    lines += [
        f"Held-out: {summary.num_questions} {cfg.task} test questions, the same for every "
        f"run; k={k} samples at the rollout temperature plus greedy. Mean ± sample std over "
        f"seeds {cfg.seeds}.\n",
    ]
    rows = []
    if summary.sft_start is not None:
        start = summary.sft_start
        rows.append(
            [
                f"({SFT_START})",
                "–",
                f"{start.mean_at_k:.3f}",
                f"{start.best_at_k:.3f}",
                f"{start.greedy_em:.3f}",
            ]
        )
    for name, arm in summary.arms.items():
        quality = [format_spread(spread) for _, spread in arm.quality().items()]
        rows.append([name, len(arm.seeds), *quality])
    lines.append(markdown_table(["arm", "seeds", f"Mean@{k}", f"Best@{k}", "greedy EM"], rows))
    lines += rise_lines(summary)
    lines += paired_tables(summary)
    lines += cost_tables(summary)
    markdown = "\n".join(lines)
    if charts is not None:
        markdown += "\nCharts: " + ", ".join(f"[{p.name}](charts/{p.name})" for p in charts) + "\n"
    return markdown


METRIC_NAMES = {"mean_at_k": "Mean@k", "best_at_k": "Best@k", "greedy_em": "greedy EM"}


def contrast_tables(summary: ExperimentSummary, cfg: ExperimentConfig) -> list[str]:
    """The declared contrasts, primary ones first: estimate, interval, MDE, verdict."""
    if not summary.contrasts:
        return []
    level = round(100 * (1 - cfg.alpha))
    rows = [
        [
            "**primary**" if c.primary else "secondary",
            f"{c.arm} − {c.reference}",
            METRIC_NAMES[c.metric].replace("k", str(summary.k)),
            f"{len(c.seeds)} x {c.questions}",
            f"{c.estimate:+.4f}",
            f"[{c.low:+.4f}, {c.high:+.4f}]" + ("*" if "conservative" in c.method else ""),
            f"[{c.seed_t.low:+.4f}, {c.seed_t.high:+.4f}]",
            f"{c.p:.3f}" + (f" (Holm {c.p_holm:.3f})" if c.p_holm is not None else ""),
            f"{c.mde:.4f}",
            c.verdict,
            format_equivalence(c.equivalence),
        ]
        for c in summary.contrasts
    ]
    return [
        f"Contrasts declared before the runs (arm − reference, paired by seed and question)."
        f" Interval: {level}% crossed random effects over seeds x questions (seed and question"
        f" effects and their interaction, each counted once; * : Satterthwaite df below 3, so"
        f" the stated conservative fallback of `evaluation.statistics.crossed_interval`);"
        f" beside it the {level}% t-interval"
        f" over seeds. MDE: the smallest true difference this design (seeds x questions x"
        f" k={summary.k}) detects with power {cfg.power:.0%} at alpha {cfg.alpha}, from the"
        " variances it measured. Verdict: + or − when p < alpha (secondary contrasts:"
        " Holm-adjusted over all of them), 0 otherwise (no difference shown, which is not"
        " equality). Equivalence: two one-sided tests at alpha against the margin the contrast"
        ' declared before the runs; "matches" is said only when they reject.\n',
        markdown_table(
            [
                "",
                "contrast",
                "metric",
                "seeds x questions",
                "estimate",
                "interval",
                "seed t-interval",
                "p",
                "MDE",
                "verdict",
                "equivalence (TOST)",
            ],
            rows,
        ),
    ]


def interim_lines(summary: ExperimentSummary, cfg: ExperimentConfig) -> list[str]:
    """Before every declared seed has run, the interim look: each measured contrast's variance
    components so far and the MDE the declared design reaches with them."""
    declared = len(cfg.seeds)
    early = [c for c in summary.contrasts if len(c.seeds) < declared]
    if not early:
        return []
    rows = []
    for c in early:
        parts = c.components
        planned = minimum_detectable_effect(
            parts, declared, c.questions, summary.k, cfg.alpha, cfg.power
        )
        rows.append(
            [
                f"{c.arm} − {c.reference}",
                METRIC_NAMES[c.metric].replace("k", str(summary.k)),
                f"{len(c.seeds)} of {declared}",
                f"{parts.seed:.2e}",
                f"{parts.question:.2e}",
                f"{parts.residual:.2e} ({parts.sampling_noise:.2e})",
                f"{c.mde:.4f}",
                f"{planned:.4f}",
            ]
        )
    return [
        f"\nInterim look, before all {declared} declared seeds: the variance components of each"
        " contrast's per-question difference so far (`evaluation.statistics.components`: seed,"
        " question, and the residual with, in brackets, the part the k samples' binomial noise"
        f" makes) and the MDE they give now and at the declared {declared} seeds x"
        f" {summary.num_questions} questions x k={summary.k}. Every declared seed runs whatever"
        " they say; the look restates the MDE and nothing else.\n",
        markdown_table(
            ["contrast", "metric", "seeds", "seed var", "question var", "residual (noise)",
             "MDE now", f"MDE at {declared} seeds"],
            rows,
        ),
    ]  # fmt: skip


def format_equivalence(eq: Equivalence | None) -> str:
    """ "matches within ±m (TOST p)" only when two one-sided tests against the margin declared
    before the runs reject; "–" when no margin was declared (no equivalence claim)."""
    if eq is None:
        return "–"
    if eq.equivalent:
        return f"matches within ±{eq.margin:g} (p {eq.p:.3f})"
    return f"not shown within ±{eq.margin:g} (p {eq.p:.3f})"


AXIS_NAMES = {
    "generated_tokens": "generated tokens",
    "env_requests": "env requests",
    "cpu_seconds": "CPU seconds",
    "wall_seconds": "wall seconds",
}


def matched_cost_tables(summary: ExperimentSummary) -> list[str]:
    """Held-out quality at equal budgets, one table per cost axis: arms as rows, budgets as
    columns, mean over seeds with its t-interval."""
    if not summary.matched_cost:
        return []
    lines = [
        "\nQuality at matched cost: in-training held-out Mean@k of each run read off its"
        " curve at equal budgets (linear interpolation between evaluations; budgets are"
        " fractions of the smallest total any arm reached), mean over seeds [95% t-interval]."
        " Generated tokens and env requests are machine-independent; CPU and wall seconds are"
        " not (compare only runs made side by side).\n"
    ]
    for axis, name in AXIS_NAMES.items():
        rows = [r for r in summary.matched_cost if r.axis == axis]
        if not rows:
            continue
        budgets = sorted({r.budget for r in rows})
        cell = {(r.arm, r.reference, r.budget): r for r in rows}
        lines_of = list(dict.fromkeys((r.arm, r.reference) for r in rows))

        def shown(row: BudgetRow) -> str:
            sign = "+" if row.reference else ""
            return f"{row.estimate:{sign}.3f} [{row.low:{sign}.3f}, {row.high:{sign}.3f}]"

        table = [
            [arm if ref is None else f"{arm} − {ref}", *(shown(cell[arm, ref, b]) for b in budgets)]
            for arm, ref in lines_of
        ]
        lines.append(f"\n{name} (rows with − : the declared contrasts, paired by seed):\n")
        lines.append(markdown_table(["arm", *(f"{b:,.0f}" for b in budgets)], table))
    return lines


def rise_lines(summary: ExperimentSummary) -> list[str]:
    """Each arm's rise over the SFT start with a 95% interval over the questions: the
    per-question difference carries the sampling noise of both evaluations, so a rise whose
    interval excludes 0 is more than a resampled start would show."""
    if not summary.rise:
        return []
    k = summary.k

    def cell(d: PairedDifference) -> str:  # a normal interval: a t-interval at infinite df
        return format_interval(t_estimate(d.diff, d.se, math.inf, 0.95, "normal"))

    rows = [[name, *(cell(d) for _, d in rise.items())] for name, rise in summary.rise.items()]
    return [
        "\nRise over the SFT start (arm − start on the same questions, per-question scores"
        " averaged over seeds; 95% normal interval over the questions, which holds the sampling"
        " noise of both evaluations):\n",
        markdown_table(["arm", f"Δ Mean@{k}", f"Δ Best@{k}", "Δ greedy EM"], rows),
    ]


def paired_tables(summary: ExperimentSummary) -> list[str]:
    """Paired differences with the crossed interval, the seed t-interval and the verdict."""
    k, rows = summary.k, []
    for name, arm in summary.arms.items():
        for ref, stats in arm.seed_stats.items():
            cells = [
                f"{format_interval(st.crossed)}<br>{format_seed_t(st.seed_t)}"
                for _, st in stats.items()
            ]
            verdicts = [st.verdict for _, st in stats.items()]
            rows.append([name, ref, len(stats.mean_at_k.seeds), *cells, " ".join(verdicts)])
    if not rows:
        return []
    return [
        "\nPaired differences (arm − reference), seeds matched (same seed: same SFT start and "
        "prompt order). First line: the mean paired difference with its 95% crossed "
        "random-effects interval over seeds x questions (`evaluation.statistics`; with too "
        "few degrees of freedom, its stated conservative fallback); `seed t`: the 95% "
        "t-interval over seeds of the per-seed difference, which ignores question effects. "
        "Verdict per metric (Mean, Best, greedy): + or − when the crossed interval's two-sided "
        'test rejects 0 at 0.05, 0 when it does not (no difference shown; not "equal"), n/a '
        "with one seed. Not Holm-corrected: descriptive beside the declared contrasts.\n",
        markdown_table(
            ["arm", "vs", "seeds", f"Δ Mean@{k}", f"Δ Best@{k}", "Δ greedy EM", "verdict"], rows
        ),
    ]


def cost_tables(summary: ExperimentSummary) -> list[str]:
    """The cost ledger per run (machine-independent counts; CPU seconds), then wall times."""
    ledger, walls = [], []
    for name, arm in summary.arms.items():
        c = {key: spread.mean for key, spread in arm.costs.items()}
        steps = max(c["steps"], 1)
        ledger.append(
            [
                name,
                f"{c['cost_fresh_groups']:.0f}",
                f"{c['cost_generated_tokens'] / 1e3:.1f}",
                f"{c['cost_behaviour_tf_tokens'] / 1e3:.1f}",
                f"{c['cost_scan_tf_tokens'] / 1e3:.1f}",
                f"{c['cost_update_tf_tokens'] / 1e3:.1f}",
                f"{c['cost_search_calls']:.0f}",
                f"{c.get('cost_billed_search_calls', c['cost_search_calls']):.0f}",
                f"{c['cost_env_requests']:.0f}",
                f"{c['cost_passages']:.0f}",
                f"{c['cost_informative_groups'] / steps:.1f}"
                f" / {c['cost_update_groups'] / steps:.1f}",
                f"{c['cost_replayed_groups']:.0f} / {c['cost_scanned_groups']:.0f}",
                f"{c['cost_cpu_s'] / 60:.1f}",
                f"{c['cost_env_wait_s'] / 60:.1f}",
            ]
        )
        walls.append(
            [
                name,
                f"{c['wall_time'] / 60:.1f}",
                f"{c['step_time_mean']:.2f}",
                *(f"{c[key]:.0f}" for key in (*TIME_KEYS, "time_other")),
                *(f"{c[key]:.0f}" for key in CPU_KEYS),
                "–"
                if math.isnan(c["acceptance_rate_mean"])
                else f"{c['acceptance_rate_mean']:.2f}",
            ]
        )
    return [
        "\nCost ledger per run (mean over seeds; `cost_*` of metrics.jsonl summed over steps). "
        "Counts are machine-independent: fresh groups rolled out (refills included), tokens in "
        "thousands (generated by the policy; teacher-forced in behaviour scoring, replay scan "
        "and update forward+backward), search tool calls, of them billed (computed by the "
        "retrieval server; the rest its result cache answered: the run's own repeats; the "
        "environment's cost in the modelled-cost comparison is the billed ones), batched env "
        "requests, passages returned; informative / all groups per update; replayed / scanned "
        "groups. The billed split depends on the server's cache as well as the run. CPU is "
        "process CPU minutes over the four phases; env wait is wall minutes waiting on the "
        "environment (emulated cost included).\n",
        markdown_table(
            [
                "arm",
                "fresh groups",
                "gen tok (k)",
                "behav tf (k)",
                "scan tf (k)",
                "update tf (k)",
                "search calls",
                "billed",
                "env req",
                "passages",
                "informative/update",
                "replayed/scanned",
                "CPU (min)",
                "env wait (min)",
            ],
            ledger,
        ),
        "\nMachine-dependent times per run (mean over seeds, seconds unless stated): wall "
        "time, mean step, the wall split by phase, and process CPU seconds by phase.\n",
        markdown_table(
            [
                "arm",
                "wall (min)",
                "step (s)",
                "generation",
                "retrieval",
                "scoring",
                "selection",
                "update",
                "other",
                "CPU rollout",
                "CPU scoring",
                "CPU selection",
                "CPU update",
                "acceptance",
            ],
            walls,
        ),
    ]
