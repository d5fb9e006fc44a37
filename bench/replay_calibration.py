"""The replay setting of a comparison, calibrated on its own SFT start before any of its runs.

    .venv-vllm/bin/python bench/replay_calibration.py --preset smollm2-replay-comparison \
        --data-dir data --out runs/calibration-smollm2

One short `headroom_drift` run from the preset's SFT start (built once, as `hdr experiment`
builds it, under the data dir) with the preset's settings, a large buffer (`--capacity`) and
`replay.survey=buffer`: at every step, before the selection and at its weights, every stored
group is scored without being admitted, so one run shows what a gate at any tau and a buffer
of any capacity would have had to choose from, step by step. From those logs:

- acceptance at three log-spaced tau (`--taus`): the share of surveyed groups a gate admits,
  beside the paper's three points (6.4 / 40.2 / 94.4%);
- per step, for each capacity in `--capacities` (the newest C groups) and each tau: the
  admissible pool, the fill ratio (min(pool, R) / R) and the share of steps whose pool exceeds
  the budget R, which is what "selection selects" asks for;
- the ages of the admissible groups (the share 3 or more steps old).

The run trains at the middle tau; the gate at another tau would have replayed other groups,
so the other points read the same buffers, not their own runs (a departure from the paper's
three runs, stated in the table). Writes JSON (`--json`, default
bench/results/replay_calibration_smollm2.json) and prints the table. Nothing from the
comparison's held-out questions is read: the run evaluates nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PAPER = {"low": 0.064, "mid": 0.402, "high": 0.944}  # the paper's three acceptance rates


def calibration_run(preset: str, data_dir: Path, out: Path, steps: int, capacity: int,
                    tau: float, seed: int) -> Path:  # fmt: skip
    """Train the calibration run (reused when its metrics are complete); its folder."""
    from experiment.config import experiment_config
    from experiment.server import ensure_index, serve
    from experiment.sft_start import ensure_sft
    from experiment.train_configs import base_train_config, shared_train_config
    from trainer.loop import train

    cfg = experiment_config(preset, data_dir=str(data_dir), out_dir=str(out))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "calibration.log"
    run_dir = out / "run"
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
        return run_dir
    index = ensure_index(cfg, log)
    with serve(index, shared_train_config(cfg).retrieval.retriever, out / "server.log") as url:
        sft_dir = ensure_sft(cfg, url, log)
        config = base_train_config(
            cfg, url, sft_dir, run_dir, seed,
            extra=["replay.rule=headroom_drift", f"steps={steps}", "eval.every=0",
                   "eval.at_start=false", "replay.survey=buffer",
                   f"replay.capacity={capacity}", f"replay.tau={tau}",
                   "checkpoint.save_every=10"],
        )  # fmt: skip
        train(config)
    return run_dir


def summarize(records: list[dict], taus: list[float], capacities: list[int], budget: int) -> dict:
    """Acceptance at each tau; per capacity x tau the pool, fill and ages, step by step."""
    from experiment.mechanism import acceptance_at, scan_acceptance

    surveyed = [r for r in records if r.get("survey_drift")]
    accepted = acceptance_at(surveyed, taus)
    acceptance = {f"{a.tau:g}": a.rate for a in accepted}
    grid = []
    for capacity in capacities:
        for tau in taus:
            pools, ages = [], []
            for r in surveyed:  # the newest `capacity` groups (the survey is newest first)
                pairs = list(zip(r["survey_ages"], r["survey_drift"], strict=True))[:capacity]
                admissible = [a for a, d in pairs if d <= tau]
                pools.append(len(admissible))
                ages += admissible
            steps = len(pools)
            grid.append({
                "capacity": capacity, "tau": tau, "steps": steps,
                "pool_median": statistics.median(pools) if pools else math.nan,
                "pool_by_step": pools,
                "fill_mean": (
                    sum(min(p, budget) for p in pools) / (budget * steps) if steps else math.nan
                ),
                "pool_over_budget": sum(p > budget for p in pools) / steps if steps else math.nan,
                "admissible_age_median": statistics.median(ages) if ages else math.nan,
                "admissible_age_3plus": sum(a >= 3 for a in ages) / len(ages) if ages else math.nan,
            })  # fmt: skip
    return {
        "steps": len(records),
        "surveyed_steps": len(surveyed),
        "surveyed_groups": accepted[0].surveyed if accepted else 0,
        "acceptance": acceptance,
        "paper_acceptance": PAPER,
        "run_scan_acceptance": scan_acceptance(records),
        "grid": grid,
        "time_step_median": statistics.median(
            r["time_step"] - r.get("time_survey", 0) for r in records
        ),
        "buffer_size_last": records[-1]["buffer_size"] if records else 0,
    }


def table(result: dict) -> str:
    from evaluation.metrics import markdown_table

    lines = [
        f"acceptance over {result['surveyed_groups']} surveyed groups"
        f" ({result['surveyed_steps']} steps; the run's own scan: "
        f"{result['run_scan_acceptance']:.1%} at tau {result['run_tau']:g}):",
        markdown_table(
            ["tau", "acceptance", "the paper's point"],
            [
                [t, f"{a:.1%}", f"{p:.1%}"]
                for (t, a), p in zip(result["acceptance"].items(), PAPER.values(), strict=True)
            ],
        ),
        f"\nthe admissible pool against the budget R = {result['budget']}, step by step:",
        markdown_table(
            [
                "capacity",
                "tau",
                "pool (median)",
                "fill",
                "steps pool > R",
                "age (median)",
                "age >= 3",
            ],
            [
                [
                    g["capacity"],
                    f"{g['tau']:g}",
                    f"{g['pool_median']:g}",
                    f"{g['fill_mean']:.2f}",
                    f"{g['pool_over_budget']:.0%}",
                    f"{g['admissible_age_median']:g}",
                    f"{g['admissible_age_3plus']:.0%}",
                ]
                for g in result["grid"]
            ],
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="smollm2-replay-comparison")
    ap.add_argument("--data-dir", type=Path, default=Path("data"))
    ap.add_argument("--out", type=Path, default=Path("runs/calibration-smollm2"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--capacity", type=int, default=128, help="The run's buffer (the largest).")
    ap.add_argument("--capacities", default="16,32,64,128")
    ap.add_argument("--taus", default="0.01,0.03,0.1", help="Three log-spaced points.")
    ap.add_argument("--budget", type=int, help="R (default: the preset's).")
    ap.add_argument("--seed", type=int, default=0, help="Not one of the comparison's seeds.")
    ap.add_argument(
        "--json", type=Path, default=REPO / "bench/results/replay_calibration_smollm2.json"
    )
    args = ap.parse_args()

    from experiment.config import experiment_config
    from experiment.train_configs import shared_train_config

    taus = [float(t) for t in args.taus.split(",")]
    capacities = [int(c) for c in args.capacities.split(",")]
    cfg = experiment_config(args.preset)
    budget = args.budget or shared_train_config(cfg).replay.budget
    started = time.perf_counter()
    run_dir = calibration_run(args.preset, args.data_dir, args.out, args.steps, args.capacity,
                              taus[len(taus) // 2], args.seed)  # fmt: skip
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    result = summarize(records, taus, capacities, budget)
    result |= {
        "command": " ".join(sys.argv),
        "preset": args.preset,
        "budget": budget,
        "run_tau": taus[len(taus) // 2],
        "run_capacity": args.capacity,
        "seed": args.seed,
        "wall_s": time.perf_counter() - started,
        "loadavg": list(os.getloadavg()),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(args.json)
    print(table(result))


if __name__ == "__main__":
    main()
