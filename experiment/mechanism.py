"""The paper's mechanism views of a replay comparison, from the runs' own logs.

Each view reads what training wrote (`metrics.jsonl` lines and `groups.jsonl`, the groups that
left the buffer or were in it at the end) and returns plain numbers; `mechanism_lines` puts
them in results.md beside the verdict:

- `acceptance_at`: the share of surveyed stored groups whose drift is at most each tau
  (`replay.survey: buffer`, the calibration), beside the scan's own admitted / scanned;
- `replay_ages`: how old the replayed groups were, and the share from `min_age` or more steps
  back (the paper: 44% from 3 or more for Headroom-Drift);
- `lifetime_by_headroom`: per bin of initial Headroom, the chance that a group was ever
  replayed and its mean replay count, and the share of all replays that went to the top bin;
- `counterfactual`: per step, the Policy Drift and current Headroom of what `replay_recency`
  would have chosen from the same buffer (`replay.survey: newest`) against what the rule chose;
  the share of steps whose choice has both less drift and more headroom, early and late;
- `entropy_at_matched_score`: policy entropy at the first step each run's smoothed training
  reward reaches a level, for levels both runs reach.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from experiment.runs import RunResult

Record = dict[str, Any]


@dataclass(frozen=True)
class Acceptance:
    tau: float
    surveyed: int
    admissible: int

    @property
    def rate(self) -> float:
        return self.admissible / self.surveyed if self.surveyed else float("nan")


def acceptance_at(records: Sequence[Record], taus: Sequence[float]) -> list[Acceptance]:
    """Over every step's surveyed groups (`survey_drift`), how many a gate at each tau admits."""
    drifts = np.array([d for r in records for d in r.get("survey_drift") or []], dtype=float)
    return [Acceptance(t, len(drifts), int((drifts <= t).sum())) for t in taus]


def scan_acceptance(records: Sequence[Record]) -> float:
    """The scan's own acceptance over a run: admitted / scanned, summed over steps (NaN when
    nothing was scanned)."""
    scanned = sum(r.get("scanned_groups") or 0 for r in records)
    admitted = sum(r.get("replayed_groups") or 0 for r in records if r.get("scanned_groups"))
    return admitted / scanned if scanned else float("nan")


@dataclass(frozen=True)
class Ages:
    replayed: int
    median: float
    share_old: float  # from `min_age` or more steps back
    min_age: int


def replay_ages(records: Sequence[Record], min_age: int = 3) -> Ages:
    """The ages (steps since entry) of every replayed group of a run."""
    ages = np.array([a for r in records for a in r.get("replay_ages") or []], dtype=float)
    if not len(ages):
        return Ages(0, float("nan"), float("nan"), min_age)
    return Ages(len(ages), float(np.median(ages)), float((ages >= min_age).mean()), min_age)


@dataclass(frozen=True)
class HeadroomBin:
    low: float
    high: float
    groups: int
    replayed_share: float  # ever replayed
    mean_replays: float


@dataclass(frozen=True)
class Lifetime:
    bins: list[HeadroomBin]
    top_bin_share: float  # of all replays, the share the highest-headroom bin received


def lifetime_by_headroom(groups: Sequence[Record], bins: int = 4) -> Lifetime | None:
    """Groups binned by initial Headroom at their quantiles (equal counts): per bin the share
    ever replayed and the mean replay count over the group's life in the buffer. None without
    groups."""
    rows = [g for g in groups if g.get("initial_headroom") is not None]
    if not rows:
        return None
    h = np.array([g["initial_headroom"] for g in rows], dtype=float)
    count = np.array([g["replay_count"] for g in rows], dtype=float)
    edges = np.quantile(h, np.linspace(0, 1, bins + 1))
    which = np.clip(np.searchsorted(edges, h, side="right") - 1, 0, bins - 1)
    out = []
    for b in range(bins):
        inside = which == b
        n = int(inside.sum())
        out.append(
            HeadroomBin(
                low=float(edges[b]),
                high=float(edges[b + 1]),
                groups=n,
                replayed_share=float((count[inside] > 0).mean()) if n else float("nan"),
                mean_replays=float(count[inside].mean()) if n else float("nan"),
            )
        )
    total = count.sum()
    top = float(count[which == bins - 1].sum() / total) if total else float("nan")
    return Lifetime(out, top)


@dataclass(frozen=True)
class Counterfactual:
    steps: int  # steps where both choices were non-empty
    same_choice: int  # steps where the rule chose exactly recency's groups
    improved_early: float  # share of the first half's steps in the jointly improved quadrant
    improved_late: float
    drift_chosen: float  # mean over steps
    drift_recency: float
    headroom_chosen: float
    headroom_recency: float


def counterfactual(records: Sequence[Record]) -> Counterfactual | None:
    """The rule's choice against recency's from the same buffer, step by step: jointly improved
    when its mean drift is lower and its mean current headroom higher. None without a survey."""
    steps = []
    for r in records:
        chosen_d, chosen_h = r.get("survey_chosen_drift"), r.get("survey_chosen_headroom")
        recency_d, recency_h = r.get("survey_drift"), r.get("survey_headroom")
        if not (chosen_d and chosen_h and recency_d and recency_h):
            continue
        same = set(r.get("replayed_group_ids") or []) == set(r.get("survey_group_ids") or [])
        steps.append(
            (r["step"], np.mean(chosen_d), np.mean(recency_d), np.mean(chosen_h),
             np.mean(recency_h), same)
        )  # fmt: skip
    if not steps:
        return None
    steps.sort()
    arr = np.array([s[1:5] for s in steps], dtype=float)  # (steps, 4)
    improved = (arr[:, 0] < arr[:, 1]) & (arr[:, 2] > arr[:, 3])
    half = (len(steps) + 1) // 2
    late = improved[half:]
    return Counterfactual(
        steps=len(steps),
        same_choice=sum(s[5] for s in steps),
        improved_early=float(improved[:half].mean()),
        improved_late=float(late.mean()) if len(late) else float("nan"),
        drift_chosen=float(arr[:, 0].mean()),
        drift_recency=float(arr[:, 1].mean()),
        headroom_chosen=float(arr[:, 2].mean()),
        headroom_recency=float(arr[:, 3].mean()),
    )


def smoothed(values: Sequence[float], window: int) -> np.ndarray:
    """The trailing mean over `window` steps (fewer at the start)."""
    x = np.asarray(values, dtype=float)
    sums = np.cumsum(np.insert(x, 0, 0.0))
    lo = np.maximum(np.arange(1, len(x) + 1) - window, 0)
    return (sums[1:] - sums[lo]) / (np.arange(1, len(x) + 1) - lo)


def entropy_at_matched_score(
    runs: dict[str, Sequence[Record]], levels: int = 3, window: int = 10
) -> list[tuple[float, dict[str, float]]]:
    """For `levels` training-reward levels every run reaches (evenly inside the lowest of the
    runs' best smoothed rewards), each run's smoothed entropy at the first step its smoothed
    reward reaches the level."""
    curves = {}
    for name, records in runs.items():
        rows = sorted((r for r in records if r.get("entropy") is not None), key=lambda r: r["step"])
        if rows:
            reward = smoothed([r["reward_mean"] for r in rows], window)
            entropy = smoothed([r["entropy"] for r in rows], window)
            curves[name] = (reward, entropy)
    if len(curves) < 2:
        return []
    low = max(c[0][0] for c in curves.values())
    high = min(c[0].max() for c in curves.values())
    if high <= low:
        return []
    out = []
    for level in np.linspace(low, high, levels + 1)[1:]:
        at = {name: float(e[int(np.argmax(r >= level))]) for name, (r, e) in curves.items()}
        out.append((float(level), at))
    return out


# --- one experiment's mechanism table -------------------------------------------------------


@dataclass(frozen=True)
class ArmMechanism:
    arm: str
    runs: int
    scan_acceptance: float
    ages: Ages
    lifetime: Lifetime | None
    counterfactual: Counterfactual | None


@dataclass(frozen=True)
class MechanismSummary:
    arms: list[ArmMechanism]
    entropy: list[tuple[float, dict[str, float]]]


def read_groups(run_dir: Path) -> list[Record]:
    """A run's groups.jsonl (empty when the run kept none)."""
    path = Path(run_dir) / "groups.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_mechanism(
    arms: dict[str, list[RunResult]], entropy_arms: Sequence[str] = ()
) -> MechanismSummary | None:
    """Every replaying arm's views, its seeds pooled; entropy at matched training score between
    `entropy_arms` (each arm's seeds' records averaged step by step). None when no arm
    replayed."""
    rows = []
    for name, runs in arms.items():
        records = [r for run in runs for r in run.metrics]
        if not any(r.get("replay_ages") for r in records):
            continue
        groups = [g for run in runs for g in read_groups(run.run_dir)]
        cf = [c for c in (counterfactual(run.metrics) for run in runs) if c is not None]
        rows.append(
            ArmMechanism(
                arm=name,
                runs=len(runs),
                scan_acceptance=scan_acceptance(records),
                ages=replay_ages(records),
                lifetime=lifetime_by_headroom(groups),
                counterfactual=pooled(cf),
            )
        )
    if not rows:
        return None
    curves = {name: mean_curve(arms[name]) for name in entropy_arms if arms.get(name)}
    return MechanismSummary(rows, entropy_at_matched_score(curves) if len(curves) > 1 else [])


def pooled(parts: Sequence[Counterfactual]) -> Counterfactual | None:
    """Several runs' counterfactuals as one: step counts summed, shares and means weighted by
    steps."""
    if not parts:
        return None
    w = np.array([p.steps for p in parts], dtype=float)

    def avg(name: str) -> float:
        return float(np.average([getattr(p, name) for p in parts], weights=w))

    return Counterfactual(
        steps=int(w.sum()),
        same_choice=sum(p.same_choice for p in parts),
        **{name: avg(name) for name in (
            "improved_early", "improved_late", "drift_chosen", "drift_recency",
            "headroom_chosen", "headroom_recency",
        )},
    )  # fmt: skip


def mean_curve(runs: Sequence[RunResult]) -> list[Record]:
    """The seeds' training reward and entropy averaged step by step (steps every run has)."""
    by_step: dict[int, list[Record]] = {}
    for run in runs:
        for r in run.metrics:
            if r.get("entropy") is not None:
                by_step.setdefault(r["step"], []).append(r)
    return [
        {
            "step": step,
            "reward_mean": float(np.mean([r["reward_mean"] for r in rs])),
            "entropy": float(np.mean([r["entropy"] for r in rs])),
        }
        for step, rs in sorted(by_step.items())
        if len(rs) == len(runs)
    ]


def pct(x: float, digits: int = 0) -> str:
    return "–" if np.isnan(x) else f"{x:.{digits}%}"


PAPER_ROW = [
    "*the paper* (Search-R1, Qwen2.5-3B)", "–", "40.2% (middle tau)", "–", "–",
    "44% (recency: 0%)", "< 0.24 below initial Headroom 0.8, > 0.56 above", "–",
    "most steps, fewer late", "lower", "higher, less so late",
]  # fmt: skip
"""The paper's figures for Headroom-Drift, in the table's columns, for comparison."""


def mechanism_lines(m: MechanismSummary) -> list[str]:
    """results.md's mechanism table (the paper's figures as numbers)."""
    from evaluation.metrics import markdown_table

    rows = []
    for a in m.arms:
        cf, life = a.counterfactual, a.lifetime
        rows.append([
            a.arm, a.runs,
            pct(a.scan_acceptance, 1), a.ages.replayed, f"{a.ages.median:.0f}",
            pct(a.ages.share_old),
            "–" if life is None else " / ".join(f"{b.replayed_share:.2f}" for b in life.bins),
            "–" if life is None else pct(life.top_bin_share),
            "–" if cf is None else f"{pct(cf.improved_early)} / {pct(cf.improved_late)}",
            "–" if cf is None else f"{cf.drift_chosen:.4f} vs {cf.drift_recency:.4f}",
            "–" if cf is None else f"{cf.headroom_chosen:.3f} vs {cf.headroom_recency:.3f}",
        ])  # fmt: skip
    rows.append(PAPER_ROW)
    head = [
        "arm", "runs", "scan acceptance", "replayed", "median age", "age >= 3",
        "P(replayed) by initial-Headroom quartile", "replays to top quartile",
        "jointly improved vs recency (early / late)", "drift (chosen vs recency)",
        "headroom (chosen vs recency)",
    ]  # fmt: skip
    lines = [
        "**Mechanism** (the paper's views, from the same runs):",
        "",
        markdown_table(head, rows),
    ]
    if m.entropy:
        names = list(m.entropy[0][1])
        erows = [[f"{level:.3f}", *(f"{at[n]:.3f}" for n in names)] for level, at in m.entropy]
        lines += [
            "Policy entropy at matched training score (smoothed over 10 steps, seeds averaged;"
            " the paper: the replay run reaches the low-entropy regime later than"
            " on_policy_larger at the same score):",
            "",
            markdown_table(["training reward", *names], erows),
        ]
    return lines
