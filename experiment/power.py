"""`hdr power`: choose the experiment's design by its power, from pilot runs, before the arms run.

A pilot is an experiment out dir (or several) whose runs were evaluated on the held-out set
(`runs/<arm>/seed-<n>/heldout/eval.json`, the SFT start's `sft_start/eval.json`). For each
contrast (the pilot's declared ones, or `--pair ARM,REF`), the variance components of the
paired difference are measured (`evaluation.statistics.components`) and the minimum
detectable effect is printed for every design asked for (seeds x questions x k).

When the pilot ran only one of a contrast's two arms (a cheap pilot: one arm, a few seeds),
the components come from that arm's seeds as a proxy: two independent training runs of an
arm differ by twice its seed variance and twice its residual, and the question effects of a
difference between arms (questions where one arm is better whatever the seed) are taken as
0 since they cannot be seen in one arm. The output says which rows are proxies.

Go/no-go: RL must move the score by much more than the design can resolve before arms are
compared; each pilot run's gain over the SFT start is printed beside three times the primary
contrast's MDE.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.errors import UserError
from evaluation.statistics import (
    Components,
    binomial_noise,
    components,
    minimum_detectable_effect,
    sampling_noise,
)
from experiment.summary import QUALITY_METRICS, correct_samples


@dataclass(frozen=True)
class Design:
    seeds: int
    questions: int
    k: int


@dataclass(frozen=True)
class PowerRow:
    contrast: str
    metric: str
    source: str  # "paired" (both arms in the pilot) or "proxy: <arm>'s seeds"
    parts: Components
    mde: dict[Design, float]


def pilot_reports(dirs: list[Path]) -> tuple[dict[str, dict[int, object]], object | None]:
    """{arm: {seed: EvalReport}} over the pilot dirs, and the SFT start's report (or None)."""
    from evaluation.evaluate import load_report

    arms: dict[str, dict[int, object]] = {}
    start = None
    for root in dirs:
        if not root.is_dir():
            raise UserError(f"pilot dir not found: {root}")
        for path in sorted(root.glob("runs/*/seed-*/heldout/eval.json")):
            arm, seed = path.parts[-4], int(path.parts[-3].removeprefix("seed-"))
            arms.setdefault(arm, {})[seed] = load_report(path)
        if (root / "sft_start" / "eval.json").is_file():
            start = load_report(root / "sft_start" / "eval.json")
    if not arms:
        raise UserError(
            f"no evaluated runs under {', '.join(map(str, dirs))} (runs/*/seed-*/heldout)"
        )
    return arms, start


def declared_pairs(dirs: list[Path]) -> list[tuple[str, str, str, bool]]:
    """(arm, reference, metric, primary) of the pilot's declared contrasts."""
    pairs = []
    for root in dirs:
        path = root / "experiment_config.json"
        if path.is_file():
            for c in json.loads(path.read_text()).get("contrasts", []):
                pairs.append((c["arm"], c["reference"], c["metric"], c["primary"]))
    return pairs


def contrast_components(
    arms: dict[str, dict[int, object]], arm: str, reference: str, metric: str
) -> tuple[Components, str]:
    """The contrast's components, paired when the pilot ran both arms on 2+ common seeds,
    else from whichever arm it ran on 2+ seeds (the module's proxy)."""
    short = dict(QUALITY_METRICS)[metric]
    mine, theirs = arms.get(arm, {}), arms.get(reference, {})
    seeds = sorted(set(mine) & set(theirs))
    if len(seeds) >= 2:
        a = np.stack([mine[s].per_question(short) for s in seeds])
        b = np.stack([theirs[s].per_question(short) for s in seeds])
        noise = 0.0
        if metric == "mean_at_k":
            noise = sampling_noise(
                np.stack([correct_samples(mine[s]) for s in seeds]),
                np.stack([correct_samples(theirs[s]) for s in seeds]),
            )
        return components(a - b, noise, mine[seeds[0]].k), "paired"
    for name, runs in ((reference, theirs), (arm, mine)):
        if len(runs) >= 2:
            seeds = sorted(runs)
            y = np.stack([runs[s].per_question(short) for s in seeds])  # (S, Q)
            noise = 0.0
            if metric == "mean_at_k":
                noise = binomial_noise(np.stack([correct_samples(runs[s]) for s in seeds]))
            one = components(y, noise, runs[seeds[0]].k)
            difference = Components(
                seed=2 * one.seed, question=0.0, residual=2 * one.residual,
                sampling_noise=2 * one.sampling_noise, seeds=one.seeds,
                questions=one.questions, k=one.k,
            )  # fmt: skip
            return difference, f"proxy: {name}'s {len(seeds)} seeds"
    raise UserError(
        f"the pilot has neither {arm} and {reference} on two common seeds nor either on two"
        " seeds: run more pilot seeds"
    )


def power_table(
    dirs: list[Path],
    designs: list[Design],
    pairs: list[tuple[str, str, str, bool]] | None = None,
    alpha: float = 0.05,
    power: float = 0.8,
) -> tuple[list[PowerRow], list[str]]:
    """The MDE of each contrast under each design, and the go/no-go lines."""
    arms, start = pilot_reports(dirs)
    pairs = pairs or declared_pairs(dirs)
    if not pairs:
        raise UserError("no contrast to size: declare contrasts in the pilot or pass --pair")
    rows = []
    for arm, reference, metric, primary in pairs:
        parts, source = contrast_components(arms, arm, reference, metric)
        mde = {
            d: minimum_detectable_effect(parts, d.seeds, d.questions, d.k, alpha, power)
            for d in designs
        }
        name = f"{arm} − {reference}" + (" (primary)" if primary else "")
        rows.append(PowerRow(name, metric, source, parts, mde))
    notes = []
    if start is not None:
        primary = next((r for r, p in zip(rows, pairs, strict=True) if p[3]), rows[0])
        needed = {d: 3 * primary.mde[d] for d in designs}
        for arm, runs in arms.items():
            for seed, report in sorted(runs.items()):
                gain = report.average["mean_at_k"] - start.average["mean_at_k"]
                verdicts = ", ".join(
                    f"{'GO' if gain >= needed[d] else 'NO-GO'} for {d.seeds}x{d.questions}x{d.k}"
                    f" (3 x MDE {needed[d]:.4f})"
                    for d in designs
                )
                notes.append(
                    f"{arm} seed {seed}: Mean@k gain over the SFT start {gain:+.4f}: {verdicts}"
                )
    return rows, notes


def print_power(rows: list[PowerRow], notes: list[str], designs: list[Design]) -> str:
    from evaluation.metrics import markdown_table

    designs_named = [f"MDE {d.seeds}x{d.questions}x{d.k}" for d in designs]
    headers = ["contrast", "metric", "components from", "seed var", "question var",
               "residual var", *designs_named]  # fmt: skip
    table = [
        [r.contrast, r.metric, r.source, f"{r.parts.seed:.2e}", f"{r.parts.question:.2e}",
         f"{r.parts.residual:.2e}", *(f"{r.mde[d]:.4f}" for d in designs)]
        for r in rows
    ]  # fmt: skip
    return markdown_table(headers, table) + "".join(f"\n{n}" for n in notes) + "\n"
