"""PNG charts from run directories (`hdr plot`), the paper's mechanism views on our runs.

Reads only the files a run dir holds (docs/design.md): `config.yaml`, `metrics.jsonl`,
`eval.jsonl`, `groups.jsonl`. Which lines a chart has (`line_groups`): `hdr plot` draws one
line per run, labelled by arm and seed; the experiment's charts draw one line per arm, its
seeds averaged (the mean, with the min-max over seeds shaded and a footnote saying so). Either
way two runs of one arm with the same seed are never counted as two seeds (each keeps its own
line, named by its folder), and runs of one arm whose configs differ (beyond seed and out_dir)
carry the differing settings in their labels (the server's URL, logging and checkpointing
aside). The charts:

- `heldout_vs_env_calls.png`, `heldout_vs_wall_time.png`: held-out Mean@k against cumulative
  environment cost and against wall time (the paper's cost axes). Environment cost is counted
  in episodes (step x b x G from the run's config): `env_calls_total` counts batched HTTP
  requests, one per search turn whatever the batch size, which would hide that a larger
  fresh batch costs more; without a config it falls back to `env_calls_total`. These curves
  come from the small periodic in-training evaluation (its size and k are in the title); where
  a run has the experiment's final evaluation (`heldout/eval.json`, the tables' numbers), a
  diamond marks it at the line's end. The wall-time chart says in a footnote that wall times
  only compare runs made side by side;
- `quality_vs_<cost>.png` for generated tokens, environment requests and CPU seconds:
  held-out Mean@k (solid) and Best@k (dashed) against the cumulative cost ledger
  (`cost_*` in metrics.jsonl) at each evaluation step, band = min-max over seeds; tokens and
  requests are machine-independent, CPU seconds are not;
- `replay_age.png`: histogram of the age (steps since entry) of replayed groups, as a
  fraction of each arm's replays (the paper contrasts headroom_drift with replay_recency);
- `acceptance_rate.png`: fraction of scanned buffer groups the gate admitted, per step;
- `replay_count_vs_headroom.png`: how often a group was replayed over its lifetime against its
  stored headroom at entry (`groups.jsonl`), binned means.

A chart whose data no run has (for example the replay charts for on-policy arms only) is
skipped; a run dir without `metrics.jsonl` is a `UserError`. `charts.json` beside the charts
lists them and each line's run dirs; the charts are drawn into a staging folder and moved into
the out dir (`core.paths`: a new or empty folder, or earlier charts with `--force`). A run
still being written may end in a half line; that last line is ignored. matplotlib is used
through `Figure` objects with the Agg canvas, never pyplot, so no display or global figure
state is involved.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from core.errors import UserError
from core.paths import CHARTS, check_output, staging_dir, swap_in
from evaluation.costs import CAVEAT as COST_CAVEAT
from evaluation.costs import PAID_WEB_SEARCH_RHO, CostModel, ModelledCostRow

# Fixed colours so an arm looks the same in every chart and every report.
ARM_COLORS = {
    "on_policy": "#7f7f7f",
    "on_policy_larger": "#1f77b4",
    "replay_recency": "#ff7f0e",
    "headroom_drift": "#d62728",
    "headroom_only": "#2ca02c",
    "drift_only": "#9467bd",
    "headroom_drift_l1": "#8c564b",
    "on_policy_filtered": "#17becf",
    "replay_freshness_per": "#e377c2",
    "replay_zero_variance_swap": "#bcbd22",
}
_FALLBACK_COLORS = ["#393b79", "#637939", "#843c39", "#7b4173", "#5254a3", "#8ca252"]
_SEED_DIR = re.compile(r"^seed[-_]?\d+$")
FINAL_EVAL = Path("heldout") / "eval.json"
WALL_TIME_CAVEAT = (
    "Wall time depends on what else ran on the machine: compare only runs made side by side."
)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file. A broken last line (a run still writing) is dropped; a broken
    line before it is a `UserError`."""
    rows: list[dict[str, Any]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise UserError(f"{path}: line {i + 1} is not JSON") from None
    return rows


@dataclass
class RunData:
    """One run dir's logs, with the arm label it is plotted under."""

    path: Path
    label: str
    seed: int | None
    metrics: list[dict[str, Any]]
    evals: list[dict[str, Any]] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    final: dict[str, Any] | None = None  # the final held-out evaluation (heldout/eval.json)

    @property
    def rollouts_per_step(self) -> int | None:
        """b x G from the run's config: fresh episodes with the environment per step."""
        grpo = self.config.get("grpo") or {}
        b, g = grpo.get("batch_prompts"), grpo.get("group_size")
        return int(b) * int(g) if isinstance(b, int) and isinstance(g, int) else None


def run_label(run_dir: Path, config: dict[str, Any]) -> str:
    """The arm a run is plotted under.

    The experiment lays runs out as `<arm label>/seed-<n>/` (its labels tell `on_policy` from
    `on_policy_larger`, which share a replay rule), so a `seed-N` directory on the path names
    its parent as the label; otherwise the config's replay rule (`replay.rule`, or `arm` in a
    config written before it), else the directory name.
    """
    for part in [run_dir, *run_dir.parents]:
        if _SEED_DIR.match(part.name) and part.parent.name:
            return part.parent.name
    replay = config.get("replay")
    rule = replay.get("rule") if isinstance(replay, dict) else None
    rule = rule or config.get("arm")
    return str(rule) if rule else run_dir.name


def load_run(run_dir: str | Path, label: str | None = None) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run dir not found: {run_dir}")
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise UserError(f"{run_dir} has no metrics.jsonl: not a training run dir")
    config: dict[str, Any] = {}
    if (run_dir / "config.yaml").is_file():
        try:
            config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        except yaml.YAMLError as err:
            raise UserError(f"{run_dir / 'config.yaml'} is not valid YAML: {err}") from None
    optional = {
        name: read_jsonl(run_dir / f"{name}.jsonl") if (run_dir / f"{name}.jsonl").is_file() else []
        for name in ("eval", "groups")
    }
    seed = config.get("seed")
    final = None
    if (run_dir / FINAL_EVAL).is_file():  # the experiment's evaluation of final/
        report = json.loads((run_dir / FINAL_EVAL).read_text())
        final = {**report["average"], "k": report["k"]}
        final["num_questions"] = sum(d["num_questions"] for d in report["datasets"])
    return RunData(
        path=run_dir,
        label=label or run_label(run_dir, config),
        seed=int(seed) if isinstance(seed, int) else None,
        metrics=read_jsonl(metrics_path),
        evals=_with_rollouts(optional["eval"], config),
        groups=optional["groups"],
        config=config,
        final=final,
    )


def _with_rollouts(evals: list[dict[str, Any]], config: dict[str, Any]) -> list[dict[str, Any]]:
    """Add `rollouts_total` (step x b x G) to eval rows: `env_calls_total` counts batched HTTP
    requests, one per search turn whatever the batch size, so it cannot show that a larger
    fresh batch costs more environment episodes."""
    grpo = config.get("grpo") or {}
    b, g = grpo.get("batch_prompts"), grpo.get("group_size")
    if not (isinstance(b, int) and isinstance(g, int)):
        return evals
    return [{**row, "rollouts_total": int(row.get("step", 0)) * b * g} for row in evals]


# What may differ between seeds of one arm without making them other settings: the seed, where
# a run writes, where its server listened (a new port each launch), how it logs and saves.
NOT_SETTINGS = {"seed", "out_dir", "generation.seed", "retrieval.urls"}
NOT_SETTING_GROUPS = ("log.", "checkpoint.")
MARKERS = ("o", "s", "^", "v", "D", "P", "X")


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def distinct_settings(runs: Sequence[RunData]) -> list[str]:
    """For each run, the settings in which the runs' configs differ (seed and out_dir aside),
    as `key=value, ...` ("" when they all agree)."""
    flat = [_flat(run.config) for run in runs]
    keys = sorted(
        k
        for k in {k for f in flat for k in f} - NOT_SETTINGS
        if not k.startswith(NOT_SETTING_GROUPS)
    )
    differ = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1]
    return [", ".join(f"{k}={f.get(k)}" for k in differ) for f in flat]


def _folder_names(runs: Sequence[RunData]) -> list[str]:
    """Short names that tell the runs' folders apart (the last one, two, ... parts)."""
    for depth in range(1, 6):
        names = ["/".join(run.path.parts[-depth:]) for run in runs]
        if len(set(names)) == len(names):
            return names
    return [str(run.path) for run in runs]


def line_groups(runs: Sequence[RunData], per_seed: bool) -> dict[str, list[RunData]]:
    """The lines of a chart: display label -> the runs behind that line, arms in table order.

    `per_seed`: one line per run (`hdr plot`), labelled `arm seed N`; else one line per arm
    with its seeds averaged (the experiment). Runs of one arm whose configs differ get their
    differing settings in the label; runs of one arm, settings and seed are never averaged as
    seeds: each gets its own line, labelled with its folder."""
    by_arm: dict[str, list[RunData]] = defaultdict(list)
    for run in runs:
        by_arm[run.label].append(run)
    order = list(ARM_COLORS)
    lines: dict[str, list[RunData]] = {}
    for arm in sorted(by_arm, key=lambda a: (order.index(a) if a in order else 99, a)):
        variants: dict[str, list[RunData]] = defaultdict(list)
        for run, settings in zip(by_arm[arm], distinct_settings(by_arm[arm]), strict=True):
            variants[settings].append(run)
        for settings, members in variants.items():
            base = f"{arm} ({settings})" if settings else arm
            seeds = [run.seed for run in members]
            folders = dict(zip((id(r) for r in members), _folder_names(members), strict=True))
            averaged = []
            for run in members:
                repeated = seeds.count(run.seed) > 1
                if not per_seed and not repeated:
                    averaged.append(run)  # one seed among the arm's seeds: averaged below
                    continue
                label = f"{base} seed {run.seed}" if per_seed else base
                lines[f"{label} [{folders[id(run)]}]" if repeated else label] = [run]
            if averaged:
                lines[base] = averaged
    return lines


def _styles(groups: dict[str, list[RunData]]) -> dict[str, tuple[str, str]]:
    """(colour, marker) per line: the arm's colour; lines of one arm differ in marker."""
    styles, seen = {}, defaultdict(int)
    for i, (label, runs) in enumerate(groups.items()):
        arm = runs[0].label
        styles[label] = (_color(arm, i), MARKERS[seen[arm] % len(MARKERS)])
        seen[arm] += 1
    return styles


def _legend(label: str, runs: list[RunData]) -> str:
    return f"{label} ({len(runs)} seeds)" if len(runs) > 1 else label


def _color(label: str, index: int) -> str:
    return ARM_COLORS.get(label, _FALLBACK_COLORS[index % len(_FALLBACK_COLORS)])


def _figure(title: str, xlabel: str, ylabel: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig, path: Path, bottom: float = 0.0) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.tight_layout(rect=(0, bottom, 1, 1))  # `bottom`: room for a footnote
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, format="png")
    tmp.replace(path)  # never a half-written chart
    return path


def _seed_curves(
    runs: list[RunData], rows_of: str, x_key: str, y_key: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Mean x, mean y, min y, max y over seeds, at the row indices all seeds have."""
    series = []
    for run in runs:
        rows = [
            r
            for r in getattr(run, rows_of)
            if r.get(x_key) is not None and r.get(y_key) is not None
        ]
        if rows:
            series.append(rows)
    if not series:
        return None
    n = min(len(s) for s in series)
    xs = np.array([[float(s[i][x_key]) for i in range(n)] for s in series])  # (S, n)
    ys = np.array([[float(s[i][y_key]) for i in range(n)] for s in series])  # (S, n)
    return xs.mean(0), ys.mean(0), ys.min(0), ys.max(0)


def _line_chart(
    groups: dict[str, list[RunData]],
    rows_of: str,
    x_key: str,
    y_key: str,
    title: str,
    xlabel: str,
    ylabel: str,
    path: Path,
    x_scale: float = 1.0,
    smooth: int = 1,
    note: str = "",
    final_of=None,
    final_label: str = "",
) -> Path | None:
    """One line per label (mean over seeds), the min-max band over seeds, and, with
    `final_of(runs) -> float | None`, a diamond at the line's end for the final evaluation."""
    fig, ax = _figure(title, xlabel, ylabel)
    drawn = banded = finals = False
    styles = _styles(groups)
    for label, runs in groups.items():
        curve = _seed_curves(runs, rows_of, x_key, y_key)
        if curve is None:
            continue
        x, y, lo, hi = curve
        if smooth > 1 and len(y) >= smooth:
            kernel = np.ones(smooth) / smooth
            y, lo, hi = (np.convolve(v, kernel, mode="valid") for v in (y, lo, hi))
            x = x[smooth - 1 :]
        color, marker = styles[label]
        ax.plot(
            x * x_scale,
            y,
            color=color,
            marker=marker if len(x) < 30 else None,
            ms=3,
            label=_legend(label, runs),
        )
        if len(runs) > 1:
            ax.fill_between(x * x_scale, lo, hi, color=color, alpha=0.15, linewidth=0)
            banded = True
        if final_of is not None:
            final = final_of(runs)
            if final is not None:
                ax.plot([x[-1] * x_scale], [final], color=color, marker="D", ms=6, ls="none")
                finals = True
        drawn = True
    if not drawn:
        return None
    notes = [*([note] if note else [])]
    if banded:
        notes.insert(0, "Shaded: min-max over seeds.")
    if finals and final_label:
        notes.insert(0, f"Diamonds: {final_label}.")
    ax.legend(fontsize=8)
    if notes:
        fig.text(0.01, 0.01, " ".join(notes), fontsize=7, wrap=True, va="bottom")
    return _save(fig, path, bottom=0.12 if notes else 0.0)


def plot_heldout(groups: dict[str, list[RunData]], out_dir: Path) -> list[Path]:
    """Held-out Mean@k of the periodic in-training evaluation (a small fixed subset), with
    the final evaluation's Mean@k (the number the tables report) as a diamond at each end."""
    rows = [r for runs in groups.values() for run in runs for r in run.evals]
    k = next((r.get("k") for r in rows), None)
    n = next((r.get("num_questions") for r in rows), None)
    ylabel = f"held-out Mean@{k or 'k'}"
    subset = f"in-training evaluation, {n} questions, k={k}" if n else "in-training evaluation"
    finals = [run.final for runs in groups.values() for run in runs if run.final]
    final_label = ""
    if finals:
        final_label = (
            f"final evaluation, Mean@{finals[0]['k']} on {finals[0]['num_questions']} questions"
            " (mean over seeds), as in the tables"
        )

    def final_of(runs: list[RunData]) -> float | None:
        values = [run.final["mean_at_k"] for run in runs if run.final]
        return float(np.mean(values)) if values else None

    has_rollouts = all("rollouts_total" in r for rs in groups.values() for x in rs for r in x.evals)
    x_key, x_label = (
        ("rollouts_total", "environment episodes (fresh rollouts, b x G per step)")
        if has_rollouts
        else ("env_calls_total", "environment calls (batched retrieval requests)")
    )
    common = dict(final_of=final_of, final_label=final_label)
    made = [
        _line_chart(
            groups,
            "evals",
            x_key,
            "mean_at_k",
            f"Held-out reward against environment cost\n({subset})",
            x_label,
            ylabel,
            out_dir / "heldout_vs_env_calls.png",
            **common,
        ),
        _line_chart(
            groups,
            "evals",
            "wall_time_total",
            "mean_at_k",
            f"Held-out reward against wall time\n({subset})",
            "wall time (minutes)",
            ylabel,
            out_dir / "heldout_vs_wall_time.png",
            x_scale=1 / 60,
            note=WALL_TIME_CAVEAT,
            **common,
        ),
    ]
    return [p for p in made if p is not None]


COST_AXES = {
    "generated_tokens": (("cost_generated_tokens",), "generated tokens (fresh rollouts)", 1.0),
    "env_requests": (("cost_env_requests",), "environment requests (batched HTTP)", 1.0),
    "cpu_seconds": (
        ("cost_cpu_rollout_s", "cost_cpu_scoring_s", "cost_cpu_selection_s", "cost_cpu_update_s"),
        "process CPU minutes (rollout + scoring + selection + update)",
        1 / 60,
    ),
}


def with_cumulative_cost(
    metrics: list[dict[str, Any]], evals: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A run's eval rows with `cum_<axis>`: each cost axis of `COST_AXES` summed over the
    steps up to the row's (from metrics.jsonl's ledger), and `cum_wall_seconds`."""
    totals = dict.fromkeys(COST_AXES, 0.0)
    by_step: dict[int, dict[str, float]] = {0: {**totals, "wall_seconds": 0.0}}
    for row in metrics:
        if not all(k in row for keys, _, _ in COST_AXES.values() for k in keys):
            return []  # a run logged before the cost ledger existed
        for axis, (keys, _, _) in COST_AXES.items():
            totals[axis] += sum(float(row[k]) for k in keys)
        by_step[int(row["step"])] = {**totals, "wall_seconds": float(row["wall_time_total"])}
    return [
        {**e, **{f"cum_{a}": v for a, v in by_step[int(e["step"])].items()}}
        for e in evals
        if int(e.get("step", -1)) in by_step
    ]


def plot_quality_vs_cost(groups: dict[str, list[RunData]], out_dir: Path) -> list[Path]:
    """Held-out Mean@k and Best@k against each cumulative cost axis, one line per arm."""
    costed = {
        label: [
            RunData(
                r.path,
                r.label,
                r.seed,
                r.metrics,
                with_cumulative_cost(r.metrics, r.evals),
                config=r.config,
            )
            for r in runs
        ]
        for label, runs in groups.items()
    }
    k = next((r.get("k") for runs in groups.values() for run in runs for r in run.evals), "k")
    n = next((r.get("num_questions") for rs in groups.values() for x in rs for r in x.evals), None)
    subset = f"\n(in-training evaluation, {n} questions, k={k})" if n else ""
    made = []
    for axis, (_, xlabel, scale) in COST_AXES.items():
        fig, ax = _figure(
            f"Held-out Mean@{k} (solid) and Best@{k} (dashed) against cost{subset}",
            xlabel,
            "held-out score (band: min-max over seeds)",
        )
        drawn = False
        styles = _styles(costed)
        for label, runs in costed.items():
            for metric, style in (("mean_at_k", "-"), ("best_at_k", "--")):
                curve = _seed_curves(runs, "evals", f"cum_{axis}", metric)
                if curve is None:
                    continue
                x, y, lo, hi = curve
                color, marker = styles[label]
                ax.plot(x * scale, y, style, color=color, ms=3, marker=marker,
                        label=_legend(label, runs) if style == "-" else None)  # fmt: skip
                if len(runs) > 1:
                    ax.fill_between(x * scale, lo, hi, color=color, alpha=0.12, linewidth=0)
                drawn = True
        if drawn:
            ax.legend(fontsize=7)
            made.append(_save(fig, out_dir / f"quality_vs_{axis}.png"))
    return made


def plot_modelled_cost(
    rows: Sequence[ModelledCostRow], model: CostModel, out_dir: Path
) -> Path | None:
    """Each declared contrast at matched modelled cost (the last budget fraction) against
    rho = a / c on a log axis, with its 95% t-interval over seeds: where, as a search call
    grows dearer against a teacher-forced token, one arm starts to lead or never does. The
    rho measured here and a paid web search's are marked; the caveat is the footnote."""
    contrasts = [r for r in rows if r.reference is not None]
    if not contrasts:
        return None
    last = max(r.fraction for r in contrasts)
    lines: dict[str, list[ModelledCostRow]] = defaultdict(list)
    for r in sorted((r for r in contrasts if r.fraction == last), key=lambda r: r.rho):
        lines[f"{r.arm} − {r.reference}"].append(r)
    fig, ax = _figure(
        "Declared contrasts at matched modelled cost\n"
        f"(budget: {last:g} x the smallest total any run reached)",
        "rho = a / c (one search call in teacher-forced tokens, log)",
        "held-out Mean@k difference (95% t, seeds)",
    )
    ax.set_xscale("log")
    ax.axhline(0.0, color="black", linewidth=0.8)
    for i, (label, points) in enumerate(lines.items()):
        rho = np.array([p.rho for p in points]) * 1.06 ** (i - (len(lines) - 1) / 2)  # no overlap
        est = np.array([p.estimate for p in points])
        spread = np.array([[p.estimate - p.low, p.high - p.estimate] for p in points]).T
        color = _FALLBACK_COLORS[i % len(_FALLBACK_COLORS)]
        ax.errorbar(rho, est, yerr=np.nan_to_num(spread), color=color, marker="o", ms=4,
                    capsize=2, label=f"{label} ({len(points[0].seeds)} seeds)")  # fmt: skip
    marks = ((model.env_to_compute, "measured here"), (PAID_WEB_SEARCH_RHO, "paid web search"))
    for rho, name in marks:
        ax.axvline(rho, color="grey", linestyle=":", linewidth=1)
        ax.annotate(name, (rho, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                    rotation=90, va="top", ha="right")  # fmt: skip
    ax.legend(fontsize=7)
    fig.text(0.01, 0.01, COST_CAVEAT, fontsize=7, wrap=True, va="bottom")
    return _save(fig, out_dir / "contrasts_vs_modelled_cost.png", bottom=0.14)


def plot_replay_age(groups: dict[str, list[RunData]], out_dir: Path) -> Path | None:
    ages = {
        label: [
            int(a) for run in runs for row in run.metrics for a in (row.get("replay_ages") or [])
        ]
        for label, runs in groups.items()
    }
    ages = {label: a for label, a in ages.items() if a}
    if not ages:
        return None
    top = max(max(a) for a in ages.values())
    bins = np.arange(1, top + 1)
    width = 0.8 / len(ages)
    fig, ax = _figure(
        "Age of replayed groups", "age at replay (steps since entry)", "fraction of replayed groups"
    )
    styles = _styles(groups)
    for i, (label, a) in enumerate(ages.items()):
        counts = np.array([a.count(b) for b in bins], dtype=float) / len(a)
        offset = (i - (len(ages) - 1) / 2) * width
        share3 = sum(1 for v in a if v >= 3) / len(a)
        ax.bar(
            bins + offset,
            counts,
            width=width,
            color=styles[label][0],
            label=f"{label} (n={len(a)}, age>=3: {share3:.0%})",
        )
    ax.set_xticks(bins if len(bins) <= 20 else bins[:: math.ceil(len(bins) / 20)])
    ax.legend(fontsize=8)
    return _save(fig, out_dir / "replay_age.png")


def plot_acceptance(groups: dict[str, list[RunData]], out_dir: Path) -> Path | None:
    longest = max((len(run.metrics) for runs in groups.values() for run in runs), default=0)
    return _line_chart(
        groups,
        "metrics",
        "step",
        "acceptance_rate",
        "Replay acceptance rate over training",
        "training step",
        "admitted / scanned buffer groups",
        out_dir / "acceptance_rate.png",
        smooth=5 if longest >= 25 else 1,
    )


def plot_replay_count(
    groups: dict[str, list[RunData]], out_dir: Path, bins: int = 10
) -> Path | None:
    data = {
        label: np.array(
            [
                (float(g["initial_headroom"]), float(g["replay_count"]))
                for run in runs
                for g in run.groups
                if g.get("initial_headroom") is not None and g.get("replay_count") is not None
            ]
        )
        for label, runs in groups.items()
    }
    data = {label: d for label, d in data.items() if len(d) and d[:, 1].sum() > 0}
    if not data:
        return None
    lo = min(d[:, 0].min() for d in data.values())
    hi = max(d[:, 0].max() for d in data.values())
    edges = np.linspace(lo, hi if hi > lo else lo + 1e-6, bins + 1)
    fig, ax = _figure(
        "Replays over a group's life against its headroom at entry",
        "stored headroom at entry",
        "replay count (mean per bin)",
    )
    rng = np.random.default_rng(0)
    styles = _styles(groups)
    for label, d in data.items():
        color = styles[label][0]
        jitter = rng.uniform(-0.12, 0.12, size=len(d))
        ax.scatter(d[:, 0], d[:, 1] + jitter, s=5, alpha=0.15, color=color)
        which = np.clip(np.digitize(d[:, 0], edges) - 1, 0, bins - 1)
        centres, means = [], []
        for b in range(bins):
            sel = which == b
            if sel.any():
                centres.append((edges[b] + edges[b + 1]) / 2)
                means.append(d[sel, 1].mean())
        ax.plot(centres, means, color=color, marker="o", ms=4, label=f"{label} ({len(d)} groups)")
    ax.legend(fontsize=8)
    return _save(fig, out_dir / "replay_count_vs_headroom.png")


CHARTS_INDEX = "charts.json"


def plot_runs(
    runs: Sequence[RunData],
    out_dir: str | Path,
    per_seed: bool = False,
    force: bool = False,
    modelled_cost: tuple[Sequence[ModelledCostRow], CostModel] | None = None,
) -> list[Path]:
    """Write every chart the runs have data for into `out_dir` (new, empty, or earlier charts
    with `force`: `core.paths.check_output`), with `charts.json` listing the charts and each
    line's run dirs; return the charts' paths. `per_seed`: see `line_groups`. An experiment
    passes its `modelled_cost` rows and their cost model for `plot_modelled_cost`."""
    if not runs:
        raise UserError("no run dirs to plot")
    out_dir = check_output(out_dir, CHARTS, force=force, inputs=[run.path for run in runs])
    staged = staging_dir(out_dir)
    try:
        groups = line_groups(runs, per_seed)
        made = plot_heldout(groups, staged)
        made += plot_quality_vs_cost(groups, staged)
        for chart in (plot_replay_age, plot_acceptance, plot_replay_count):
            path = chart(groups, staged)
            if path is not None:
                made.append(path)
        if modelled_cost is not None:
            path = plot_modelled_cost(*modelled_cost, staged)
            if path is not None:
                made.append(path)
        if not made:
            raise UserError(
                "nothing to plot: the runs have no eval.jsonl rows, replay ages, acceptance"
                " rates or replayed groups yet"
            )
        index = {
            "charts": [p.name for p in made],
            "lines": {
                label: [str(run.path) for run in members] for label, members in groups.items()
            },
        }
        (staged / CHARTS_INDEX).write_text(json.dumps(index, indent=1) + "\n")
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    previous = []
    if (out_dir / CHARTS_INDEX).is_file():
        previous = [*json.loads((out_dir / CHARTS_INDEX).read_text())["charts"], CHARTS_INDEX]
    swap_in(staged, out_dir, previous)
    return [out_dir / p.name for p in made]


def plot_run_dirs(
    run_dirs: Sequence[str | Path], out_dir: str | Path, force: bool = False
) -> list[Path]:
    """`hdr plot`: load each run dir (labels from their layout or config) and chart them,
    one line per run (arm and seed)."""
    return plot_runs([load_run(d) for d in run_dirs], out_dir, per_seed=True, force=force)
