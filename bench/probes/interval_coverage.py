"""How often the crossed interval (evaluation.statistics.crossed_interval) covers the true
difference, on simulated paired differences shaped like a two-seed pilot: S seeds x Q
questions, d[s, q] = seed effect + question effect + residual, true mean 0.

The interval's fallback (taken when the main estimate's Satterthwaite df is below 3) uses the
variance bound (MS_S + MS_Q) / (S Q) at that sum's own Satterthwaite df. The df is estimated
from the observed mean squares, so with two seeds, when the seed mean square comes out small
by chance, it is large and the interval narrow: this script measures what that costs.

    .venv/bin/python bench/probes/interval_coverage.py            # 4,000 draws a row, seconds

Writes bench/results/interval_coverage.json and prints a table. Counts, not times.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from evaluation.statistics import crossed_interval

REPO = Path(__file__).resolve().parents[2]
# (seed variance, question variance), residual variance 1: the pilots' question term is
# about a tenth of the residual, their seed term small
CASES = [(0.0, 0.09), (0.005, 0.09), (0.02, 0.09), (0.05, 0.09)]


def coverage(seeds: int, questions: int, seed_var: float, question_var: float, draws: int,
             rng: np.random.Generator) -> dict:  # fmt: skip
    covered = fallback = 0
    for _ in range(draws):
        d = (
            rng.normal(0, np.sqrt(seed_var), (seeds, 1))
            + rng.normal(0, np.sqrt(question_var), (1, questions))
            + rng.normal(0, 1, (seeds, questions))
        )
        estimate = crossed_interval(d)
        covered += estimate.low <= 0 <= estimate.high
        fallback += "conservative" in estimate.method
    return {
        "seeds": seeds, "questions": questions, "seed_var": seed_var,
        "question_var": question_var, "residual_var": 1.0, "draws": draws,
        "coverage": covered / draws, "fallback_share": fallback / draws,
    }  # fmt: skip


def main(
    draws: int = typer.Option(4000, help="Simulated experiments a row."),
    seeds: int = typer.Option(2, help="Seeds (S)."),
    questions: int = typer.Option(200, help="Questions (Q)."),
    out: Path = typer.Option(REPO / "bench/results/interval_coverage.json"),
) -> None:
    rng = np.random.default_rng(0)
    rows = [coverage(seeds, questions, sv, qv, draws, rng) for sv, qv in CASES]
    out.write_text(json.dumps({"level": 0.95, "rows": rows}, indent=2) + "\n")
    table = Table(title=f"95% crossed interval, S = {seeds}, Q = {questions}, {draws} draws")
    for name in ("seed var", "question var", "coverage", "fallback taken"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(f"{r['seed_var']:g}", f"{r['question_var']:g}", f"{r['coverage']:.3f}",
                      f"{r['fallback_share']:.2f}")  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
