"""Step time of Headroom-Drift Replay inside TRL against TRL without replay, and the same replay
step in hdr's own loop, on the tiny bed.

    .venv/bin/hdr serve --index data/index-bm25 --port 8000 &
    .venv/bin/python bench/trl_replay.py --config configs/trl/tiny-cpu.yaml --steps 8 \
        trl.per_device_train_batch_size=64

One run each, same policy, seed, questions, fresh batch (b prompts x G responses), rollout
settings and learning rate (taken from the TRL config; hdr's loop gets them as overrides of
configs/tiny-cpu.yaml):
- `trl`: TRL's `GRPOTrainer` with hdr's rollout function, no replay;
- `trl+hdr on_policy`: `ReplayGRPOTrainer` with the `on_policy` rule: TRL's batch turned into
  hdr's groups and scored (behaviour log-probs), nothing replayed: the integration's cost;
- `trl+hdr headroom_drift`: the same with the config's replay (budget R, tau): scan, selection
  and R more groups in the update;
- `hdr on_policy` / `hdr headroom_drift`: hdr's loop (`trainer.loop.train`) with those rules.
A TRL step is timed from `on_step_begin` to `on_step_end` (rollout, scoring, selection, loss,
backward, optimizer); an hdr step is its `time_step`. The median over the steps after the first
`--skip` (the buffer fills) is compared within each trainer. Writes
bench/results/trl_replay.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# one thread: on a shared 2-core machine two OpenMP threads per process made the same step
# take anywhere from 5 to 30 s (oversubscription), which drowned what this measures
os.environ.setdefault("OMP_NUM_THREADS", "1")

from rich.console import Console
from rich.table import Table
from transformers import TrainerCallback

from core.config import load_config
from trainer.config import TrainConfig
from trainer.integrations.trl_run import TRLRunConfig, build_trainer

HDR_CONFIG = "configs/tiny-cpu.yaml"


class StepClock(TrainerCallback):
    """Wall time of every optimizer step of a TRL run."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)


def trl_run(config: TRLRunConfig, rule: str | None, out: Path) -> dict:
    """One TRL run; `rule` None is TRL's own GRPOTrainer (no replay)."""
    rules = config.replay.replay.model_copy(update={"rule": rule or "on_policy"})
    replay = config.replay.model_copy(update={"replay": rules})
    run = config.model_copy(
        update={"replay": replay, "trl": {**config.trl, "output_dir": str(out)}}
    )
    trainer = build_trainer(run, replay=rule is not None)
    clock = StepClock()
    trainer.add_callback(clock)
    trainer.train()
    trainer.rollout_func.client.close()
    history = trainer.replay.history if rule is not None else []
    return {"step_s": clock.seconds, "replayed_groups": [len(h["replayed"]) for h in history]}


def hdr_run(config: TRLRunConfig, rule: str, steps: int, out: Path) -> dict:
    """hdr's loop with the TRL config's policy, batch, rollout, learning rate and replay."""
    from trainer.loop import train

    trl = config.trl
    b = trl["per_device_train_batch_size"] // trl["num_generations"]
    overrides = [
        f"replay.rule={rule}", f"steps={steps}", f"out_dir={out}", f"seed={trl['seed']}",
        f"model.path={config.model}", f"retrieval.urls={json.dumps(config.retrieval.urls)}",
        f"grpo.batch_prompts={b}", f"grpo.group_size={trl['num_generations']}",
        f"grpo.micro_batch={trl['per_device_train_batch_size']}", "grpo.warmup_steps=0",
        f"grpo.lr={trl['learning_rate']}", f"replay.budget={config.replay.replay.budget}",
        f"replay.capacity={config.replay.replay.capacity}",
        f"replay.tau={config.replay.replay.tau}",
        "eval.every=0", "checkpoint.save_every=0", "log.tensorboard=false", "log.progress=false",
    ]  # fmt: skip
    cfg = load_config(TrainConfig, HDR_CONFIG, overrides)
    rollout = config.rollout.model_copy(update={"on_failure": cfg.rollout.on_failure})
    cfg = cfg.model_copy(update={"rollout": rollout})
    rows = [json.loads(x) for x in (train(cfg) / "metrics.jsonl").read_text().splitlines()]
    return {
        "step_s": [r["time_step"] for r in rows],
        "replayed_groups": [r["replayed_groups"] for r in rows],
    }


RUNS = {  # name -> (trainer, replay rule)
    "trl": ("trl", None),
    "trl+hdr on_policy": ("trl", "on_policy"),
    "trl+hdr headroom_drift": ("trl", "headroom_drift"),
    "hdr on_policy": ("hdr", "on_policy"),
    "hdr headroom_drift": ("hdr", "headroom_drift"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/trl/tiny-cpu.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2, help="First steps left out (buffer fills).")
    ap.add_argument("--out", default="bench/results/trl_replay.json")
    ap.add_argument("overrides", nargs="*", help="Dotted overrides of the TRL config")
    args = ap.parse_args()
    config = load_config(TRLRunConfig, args.config, args.overrides)
    config = config.model_copy(update={"trl": {**config.trl, "max_steps": args.steps}})
    root = Path(tempfile.mkdtemp(prefix="hdr-trl-bench-"))
    results = {}
    try:
        for name, (kind, rule) in RUNS.items():
            out = root / name.replace(" ", "-")
            if kind == "trl":
                run = trl_run(config, rule, out)
            else:
                run = hdr_run(config, rule, args.steps, out)
            run["median_step_s"] = statistics.median(run["step_s"][args.skip :])
            results[name] = run
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = {
        "trl headroom_drift / trl": results["trl+hdr headroom_drift"]["median_step_s"]
        / results["trl"]["median_step_s"],
        "trl on_policy / trl": results["trl+hdr on_policy"]["median_step_s"]
        / results["trl"]["median_step_s"],
        "hdr headroom_drift / hdr on_policy": results["hdr headroom_drift"]["median_step_s"]
        / results["hdr on_policy"]["median_step_s"],
    }
    trl = config.trl
    report = {
        "config": args.config,
        "overrides": args.overrides,
        "steps": args.steps,
        "skipped_steps": args.skip,
        "batch": {
            "prompts": trl["per_device_train_batch_size"] // trl["num_generations"],
            "group_size": trl["num_generations"],
            "replay_budget": config.replay.replay.budget,
            "tau": config.replay.replay.tau,
        },
        "runs": results,
        "ratios": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    table = Table(title=f"step time, median of steps {args.skip + 1}-{args.steps} ({args.config})")
    for column in ("run", "median s/step", "replayed groups/step (mean)"):
        table.add_column(column)
    for name, run in results.items():
        replayed = run["replayed_groups"][args.skip :]
        mean = statistics.mean(replayed) if replayed else 0.0
        table.add_row(name, f"{run['median_step_s']:.3f}", f"{mean:.1f}")
    console = Console()
    console.print(table)
    for name, value in ratios.items():
        console.print(f"{name}: {value:.3f}")


if __name__ == "__main__":
    main()
