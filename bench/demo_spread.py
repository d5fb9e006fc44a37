"""The spread of `hdr demo`'s numbers over CPU settings: what a fresh install should print.

The demo's SFT start is a chaotic process: the tiny policy learns to copy a question into its
search all at once, and when (epoch 3, 4 or 5) moves with the float summation order, which
the CPU's kernels (AVX-512 or AVX2) and the thread count change. So the same commit prints
other numbers on another machine. This runs the whole demo, from an empty data dir, under
each setting and tabulates the SFT start's per-epoch greedy EM and the held-out scores of the
start and of the trained policy, so the README can state the spread, not one value, and says
whether RL's rise in every setting exceeds the widest spread of a score across them.

    .venv/bin/python bench/demo_spread.py --settings avx512-t2,avx2-t1     # ~15-25 min each

Settings are `<kernels>-t<threads>`: kernels `avx512` (the machine's best) or `avx2`
(`ATEN_CPU_CAPABILITY=avx2`), threads via `taskset` on that many cores (torch's intra-op
threads follow the cores it may use). Two 1-thread settings run side by side, one per core.
Writes bench/results/demo_spread.json (keeping the rows of settings it did not run) and prints
a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
HDR = str(Path(sys.executable).with_name("hdr"))


def environment(setting: str) -> tuple[dict[str, str], int]:
    kernels, threads = setting.split("-t")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": threads}
    if kernels == "avx2":
        env["ATEN_CPU_CAPABILITY"] = "avx2"
    elif kernels != "avx512":
        raise SystemExit(f"unknown kernels {kernels!r}: avx512 or avx2")
    return env, int(threads)


def start(setting: str, root: Path, first_core: int) -> tuple[subprocess.Popen, float]:
    env, threads = environment(setting)
    cores = ",".join(str(first_core + i) for i in range(threads))
    out = root / setting
    out.mkdir(parents=True)
    log = (out / "demo.log").open("w")
    command = ["taskset", "-c", cores, HDR, "demo", "--data-dir", str(out / "data"),
               "--out", str(out / "runs" / "demo")]  # fmt: skip
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=log), time.time()


def collect(setting: str, root: Path, seconds: float) -> dict:
    out = root / setting
    results = json.loads((out / "runs" / "demo" / "results.json").read_text())
    sft_log = next((out / "data").glob("tiny-sft-*.sft-log.jsonl"))
    epochs = [json.loads(line) for line in sft_log.read_text().splitlines()]
    arm = results["arms"]["headroom_drift"]
    return {
        "setting": setting,
        "minutes": round(seconds / 60, 1),
        "sft_greedy_em_by_epoch": [e["greedy_em"] for e in epochs],
        "sft_start": results["sft_start"],
        "trained": {m: arm["per_seed"][m][0] for m in ("mean_at_k", "best_at_k", "greedy_em")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="avx512-t2,avx2-t1,avx512-t1")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    root = Path(tempfile.mkdtemp(prefix="hdr-demo-spread-"))
    rows = []
    pending = list(settings)
    while pending:  # fill the cores: one 2-thread demo, or two 1-thread demos side by side
        batch, used = [], 0
        while pending and used + environment(pending[0])[1] <= args.cores:
            batch.append(pending.pop(0))
            used += environment(batch[-1])[1]
        if not batch:
            batch, used = [pending.pop(0)], args.cores
        running, core = [], 0
        for setting in batch:
            running.append((setting, *start(setting, root, core)))
            core += environment(setting)[1]
        for setting, proc, began in running:
            if proc.wait() != 0:
                raise SystemExit(f"{setting}: hdr demo failed; see {root / setting / 'demo.log'}")
            rows.append(collect(setting, root, time.time() - began))
    out = REPO / "bench" / "results" / "demo_spread.json"
    # settings measured by earlier calls stay (each call may run only some); a rerun replaces
    earlier = json.loads(out.read_text()) if out.is_file() else []
    rows = [r for r in earlier if r["setting"] not in settings] + rows
    out.write_text(json.dumps(rows, indent=1) + "\n")
    table = Table(title="hdr demo under CPU settings (one seed, 300 held-out questions)")
    for column in ("setting", "min", "SFT greedy EM by epoch", "start Mean@5 / Best@5 / greedy",
                   "trained Mean@5 / Best@5 / greedy"):  # fmt: skip
        table.add_column(column)
    for r in rows:
        s, t = r["sft_start"], r["trained"]
        table.add_row(
            r["setting"],
            str(r["minutes"]),
            " ".join(f"{v:.2f}" for v in r["sft_greedy_em_by_epoch"]),
            f"{s['mean_at_k']:.3f} / {s['best_at_k']:.3f} / {s['greedy_em']:.3f}",
            f"{t['mean_at_k']:.3f} / {t['best_at_k']:.3f} / {t['greedy_em']:.3f}",
        )
    Console(width=200).print(table)
    print(spread_line(rows))
    print(f"wrote {out} (runs under {root})")


def spread_line(rows: list[dict]) -> str:
    """RL's rise in each setting against how far the settings spread: the demo shows RL
    learning only where the smallest rise exceeds the widest spread of one score across them."""
    starts = [r["sft_start"]["mean_at_k"] for r in rows]
    trained = [r["trained"]["mean_at_k"] for r in rows]
    rises = [t - s for s, t in zip(starts, trained, strict=True)]
    spread = max(max(starts) - min(starts), max(trained) - min(trained))
    verdict = "above" if min(rises) > spread else "NOT above"
    return (
        f"RL's rise of Mean@5: {min(rises):+.3f} to {max(rises):+.3f}; spread across the"
        f" settings: start {max(starts) - min(starts):.3f}, trained"
        f" {max(trained) - min(trained):.3f}; the smallest rise is {verdict} the widest spread"
    )


if __name__ == "__main__":
    main()
