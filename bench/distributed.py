"""Data-parallel training: steps/s of `hdr train` in 1 process and under torchrun with 2, and
the time each spends in collectives.

    .venv/bin/hdr serve --index data/index --port 8000 &
    .venv/bin/python bench/distributed.py --config configs/tiny-cpu.yaml --steps 8

Both runs use the same config, seed and `distributed.rollout_shards` (2 unless overridden), so
they train on the same prompts and trajectories; the 1-process run does all the work, the
2-process run (gloo on 127.0.0.1, one torch thread per process) splits rollouts, replay
scoring and the update. Reported per run: median step time and steps/s, median time inside
collectives on rank 0 (all-gathers of fresh groups and scores, the gradient all-reduce's
wait, small sums), and its share of the step. The first step (process start-up, cold caches)
is left out. Writes bench/results/distributed.json and prints a table.

A 2-core machine cannot show a speed-up: two processes on two cores share them with the
retrieval server and with each other, so this measures correctness-preserving overhead (what
the collectives cost), not scaling. Scaling needs one device (or several cores) per process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]


def command(nproc: int, args: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "hdr.cli", *args]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "-m", "hdr.cli", *args,
    ]  # fmt: skip


def run(nproc: int, config: str, overrides: list[str], out: Path) -> dict:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    }
    args = ["train", "--config", config, *overrides, f"out_dir={out}"]
    start = time.perf_counter()
    subprocess.run(command(nproc, args), env=env, check=True, cwd=REPO)
    wall = time.perf_counter() - start
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    step = statistics.median(r["time_step"] for r in rows)
    coll = statistics.median(r["time_collectives"] for r in rows)
    return {
        "processes": nproc,
        "steps_measured": len(rows),
        "median_step_s": step,
        "steps_per_s": 1.0 / step,
        "median_collectives_s": coll,
        "collectives_share": coll / step,
        "median_generation_s": statistics.median(r["time_generation"] for r in rows),
        "median_update_s": statistics.median(r["time_update"] for r in rows),
        "replayed_groups_mean": statistics.mean(r["replayed_groups"] for r in rows),
        "job_wall_s": wall,
        "fresh_group_ids": [r["fresh_group_ids"] for r in rows],
        "replayed_group_ids": [r["replayed_group_ids"] for r in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="bench/results/distributed.json")
    ap.add_argument("overrides", nargs="*", help="Dotted overrides of the config")
    args = ap.parse_args()
    overrides = [
        "distributed.rollout_shards=2", *args.overrides, f"steps={args.steps}", "eval.every=0",
        "checkpoint.save_every=0", "log.tensorboard=false", "log.progress=false",
    ]  # fmt: skip
    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="hdr-distributed-"))
    try:
        results = [run(n, args.config, overrides, root / f"n{n}") for n in (1, 2)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    same = all(
        results[0][key] == results[1][key] for key in ("fresh_group_ids", "replayed_group_ids")
    )
    report = {
        "config": args.config,
        "overrides": overrides,
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "same_prompts_and_replay": same,
        "speedup_2_over_1": results[1]["steps_per_s"] / results[0]["steps_per_s"],
        "runs": [
            {k: v for k, v in r.items() if k not in ("fresh_group_ids", "replayed_group_ids")}
            for r in results
        ],
        "note": "a 2-core machine cannot show a speed-up; this measures collective overhead",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    table = Table(title=f"hdr train, 1 vs 2 processes ({os.cpu_count()} cores)")
    for col in ("processes", "steps/s", "median step (s)", "collectives (s)", "share",
                "generation (s)", "update (s)", "replayed/step"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in report["runs"]:
        table.add_row(
            str(r["processes"]), f"{r['steps_per_s']:.3f}", f"{r['median_step_s']:.2f}",
            f"{r['median_collectives_s']:.3f}", f"{r['collectives_share']:.1%}",
            f"{r['median_generation_s']:.2f}", f"{r['median_update_s']:.2f}",
            f"{r['replayed_groups_mean']:.1f}",
        )  # fmt: skip
    Console(width=140).print(table)
    print(
        f"same prompts and replay set every step: {same};"
        f" speed-up {report['speedup_2_over_1']:.2f}x"
        " (a 2-core machine cannot show a speed-up: the point is the collectives' cost)"
    )


if __name__ == "__main__":
    main()
