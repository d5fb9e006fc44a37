"""Selection overhead: median step time of `headroom_drift` over that of `replay_recency`.

    .venv/bin/hdr serve --index data/index --port 8000 &
    .venv/bin/python bench/selection_overhead.py --config configs/tiny-cpu.yaml --steps 12

Both arms train from the same model with the same seed, b, G and R (the config's), so their
fresh streams start identical; they differ only in the replay selector: `replay_recency`
takes the R newest groups without re-scoring them, `headroom_drift` re-scores candidates in
headroom order, gates them by drift and refreshes their headroom; with
`replay.reuse_scan_forward` (configs/tiny-cpu.yaml sets it; `replay.reuse_scan_forward=false`
measures without) its update backpropagates through the scan's forward of the admitted groups
instead of forwarding them again. The arms alternate
(`--repeats` runs each, interleaved) so that load on a shared machine hits both alike. Steps
before the buffer holds R groups are left out. Target: ratio at most 1.03. Writes
bench/results/selection_overhead.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rich.console import Console
from rich.table import Table

from core.config import load_config
from trainer.config import TrainConfig
from trainer.loop import train

TARGET = 1.03
ARMS = ("replay_recency", "headroom_drift")
TIMES = ("time_step", "time_generation", "time_retrieval", "time_scoring", "time_selection",
         "time_update")  # fmt: skip


def run_arm(base: list[str], config: str, arm: str, out: Path) -> list[dict]:
    cfg = load_config(TrainConfig, config, [*base, f"replay.rule={arm}", f"out_dir={out}"])
    rows = [json.loads(x) for x in (train(cfg) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["buffer_size"] >= cfg.replay.budget or r["replayed_groups"]][1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench/results/selection_overhead.json")
    ap.add_argument("overrides", nargs="*", help="Dotted overrides of the config")
    args = ap.parse_args()
    base = [
        *args.overrides, f"steps={args.steps}", "eval.every=0", "checkpoint.save_every=0",
        "log.tensorboard=false", "log.progress=false",
    ]  # fmt: skip
    steps: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    root = Path(tempfile.mkdtemp(prefix="hdr-overhead-"))
    try:
        for rep in range(args.repeats):
            for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
                steps[arm] += run_arm(base, args.config, arm, root / f"{arm}-{rep}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {
        arm: {t: statistics.median(r[t] for r in rows) for t in TIMES}
        for arm, rows in steps.items()
    }
    for arm, rows in steps.items():
        med[arm]["replayed_groups"] = statistics.mean(r["replayed_groups"] for r in rows)
        med[arm]["scanned_groups"] = statistics.mean(r["scanned_groups"] for r in rows)
        med[arm]["steps_measured"] = len(rows)
    ratio = med["headroom_drift"]["time_step"] / med["replay_recency"]["time_step"]
    ratio_excl_rollout = (
        med["headroom_drift"]["time_scoring"] + med["headroom_drift"]["time_selection"]
        + med["headroom_drift"]["time_update"]
    ) / (
        med["replay_recency"]["time_scoring"] + med["replay_recency"]["time_selection"]
        + med["replay_recency"]["time_update"]
    )  # fmt: skip
    cfg = load_config(TrainConfig, args.config, base)
    report = dict(
        config=args.config, overrides=args.overrides, steps=args.steps, repeats=args.repeats,
        b=cfg.grpo.batch_prompts, G=cfg.grpo.group_size, R=cfg.replay.budget, tau=cfg.replay.tau,
        medians=med, ratio=ratio, ratio_trainer_side=ratio_excl_rollout, target=TARGET,
        meets_target=ratio <= TARGET, load_average=os.getloadavg(),
    )  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    table = Table(title=f"median step time (s), b={report['b']}, G={report['G']}, R={report['R']}")
    table.add_column("arm")
    for col in (*TIMES, "replayed", "scanned", "steps"):
        table.add_column(col.removeprefix("time_"))
    for arm in ARMS:
        m = med[arm]
        table.add_row(arm, *(f"{m[t]:.3f}" for t in TIMES), f"{m['replayed_groups']:.1f}",
                      f"{m['scanned_groups']:.1f}", str(m["steps_measured"]))  # fmt: skip
    Console(width=160).print(table)
    verdict = "meets" if ratio <= TARGET else "MISSES"
    Console().print(
        f"ratio headroom_drift / replay_recency: {ratio:.3f} ({verdict} <= {TARGET});"
        f" trainer side only (scoring+selection+update): {ratio_excl_rollout:.3f}"
    )


if __name__ == "__main__":
    main()
