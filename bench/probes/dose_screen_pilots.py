"""The dose screen, applied after the fact to the committed pilots: would it have predicted
each bed's 1.5x step, and said "no pilot" where the gate said NO-GO?

    .venv/bin/python bench/probes/dose_screen_pilots.py

For every committed dose-response pilot (`docs/results/pilot-*`, recomputed from its per-run
files as `hdr report --from` does) it takes b = 16 against b = 4 at equal updates, projects
the 1.5x step by log-dose arithmetic (`experiment.diagnostics.dose_screen`: each
doubling buys (b16 - b4) / 2, a 1.5x step log2(1.5) of that) and puts it beside the step the
pilot measured (b12 - b8) and the gate's threshold. Counts, not times. Writes
bench/results/dose_screen_pilots.json and prints a table.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from experiment.diagnostics import DoseScreen, dose_screen
from experiment.recompute import read_config, read_runs

REPO = Path(__file__).resolve().parents[2]


def per_question(root: Path) -> dict[str, dict[int, np.ndarray]]:
    """Per arm and seed, the held-out Mean@k of each question."""
    cfg = read_config(root)
    scores: dict[str, dict[int, np.ndarray]] = {}
    for run in read_runs(root, cfg):
        scores.setdefault(run.arm, {})[run.seed] = run.report.per_question("mean")
    return scores


def bed_row(root: Path) -> dict:
    scores = per_question(root)
    seeds = sorted(scores["on_policy_b16"])
    table = lambda arm: np.stack([scores[arm][s] for s in seeds])  # noqa: E731
    results = json.loads((root / "results.json").read_text())
    needed = results["precondition"]["needed"]
    screen = DoseScreen(arm="on_policy_b16", reference="on_policy_b4", dose_ratio=4, needed=needed)
    result = dose_screen(table("on_policy_b16"), table("on_policy_b4"), seeds, screen)
    measured = float((table("on_policy_b12") - table("on_policy_b8")).mean())
    return {
        "bed": root.name.removeprefix("pilot-"),
        "b16_minus_b4": result.gain.estimate,
        "b16_minus_b4_interval": [result.gain.low, result.gain.high],
        "projected_step": result.projected_step,
        "projected_interval": list(result.projected_interval),
        "measured_step": measured,
        "needed": needed,
        "screen_passes": result.passes,
        "gate": "GO" if results["precondition"]["go"] else "NO-GO",
    }


def main() -> None:
    rows = [bed_row(root) for root in sorted((REPO / "docs" / "results").glob("pilot-*"))]
    out = REPO / "bench" / "results" / "dose_screen_pilots.json"
    out.write_text(json.dumps(rows, indent=1) + "\n")
    table = Table(title="the dose screen (b16 - b4) against each pilot's measured 1.5x step")
    for column in ("bed", "b16 - b4 [95%]", "projected 1.5x [95%]", "measured b12 - b8",
                   "needed", "screen", "gate"):  # fmt: skip
        table.add_column(column)
    for r in rows:
        lo, hi = r["b16_minus_b4_interval"]
        plo, phi = r["projected_interval"]
        table.add_row(
            r["bed"],
            f"{r['b16_minus_b4']:+.4f} [{lo:+.4f}, {hi:+.4f}]",
            f"{r['projected_step']:+.4f} [{plo:+.4f}, {phi:+.4f}]",
            f"{r['measured_step']:+.4f}",
            f"{r['needed']:.4f}",
            "pilot" if r["screen_passes"] else "no pilot",
            r["gate"],
        )
    Console(width=160).print(table)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
