"""One GRPO step with Headroom-Drift Replay on SmolLM2-135M-Instruct, part by part and lever by
lever, beside TRL's GRPOTrainer on the same model, batch and task, all in one run.

    .venv/bin/hdr serve --index data/index --port 8000 &
    .venv-vllm/bin/python bench/smollm2_step.py --model data/smollm2-sft

Each row is a short `hdr train` of `configs/smollm2-cpu.yaml` (8 prompts x 5 responses a step,
replay budget 8 of a 16-group buffer, the `rl` questions) in a process of its own, the levers
given as settings, each row adding one to the row above:

- `baseline`: hdr's path before the levers: transformers' `generate` in float32 on the
  trainer's module, every parameter trained in float32;
- `+ vllm`: generation on the vLLM engine built for the CPU (float32, prefix caching: a
  group's prompt is computed once);
- `+ bf16`: the engine in bfloat16 and every trainer forward under bf16 autocast;
- `+ top 4 layers`: `model.train_layers=4`, the frozen bottom's output kept per group, so
  the update and every later replay scan run 4 of the 30 layers;
- `+ skip zero-advantage`: `grpo.skip_zero_advantage=true`, groups whose G rewards are equal
  neither scored nor forwarded (their tokens still count in the token mean): hdr's path.

The parts are the step record's own (`metrics.jsonl`): generation, retrieval, scoring (the
behaviour log-probs), selection (the replay scan) and update (with the vLLM weight sync);
the step is `time_step`. The median over the steps after `--skip` (the first fills the
buffer; the scan runs from the second) is reported.

`--full-buffer 128,64,16` times hdr's path instead with the buffer full, every capacity at the
same point of training: one run at the largest capacity, long enough to fill it (about 1.4
groups enter a step; `--total-steps` sets its length), checkpointed at its end; each capacity's
row resumes a copy of it at that `replay.capacity` (a smaller buffer keeps the newest groups,
each group's frozen-bottom states computed at the resume) for 1 + `--steps` steps, the first
untimed, the median over the last `--steps`, each of which must have scanned a full buffer. So
the rows share the weights, the buffer's groups and the step's prompts at their start, and
differ in the capacity alone. `--shared DIR` keeps the shared run in DIR, and a later call
with the same model, length and settings resumes copies of it instead of training it again
(to time the rows again after a change that leaves training's results as they were). `--trl`
adds TRL's row to the same run (it needs about 17 GB free: nothing else large beside it).
Each row is written as it ends. Each full row also gives what one stored group costs to
re-score (the scan's seconds per scanned group) against what one fresh group costs to produce
(generation, retrieval and the behaviour log-probs, per fresh group), and the frozen-bottom
tokens the scan forwarded (0 when it runs the top layers only, on each group's kept bottom
states). `--set KEY=VALUE` adds a setting to every hdr row (the replay setting under test:
`--set replay.tau=0.03 --set replay.budget=4`).
Rows are added to the JSON (bench/results/smollm2_full_buffer.json) by name, each with its
own command, so one capacity can be timed in a later run.

`trl` is TRL's own `GRPOTrainer` through `hdr trl-train`'s pieces (configs/trl/smollm2-cpu.yaml:
the same model, questions, prompt, rollout, batch and learning rate, TRL's colocated vLLM
engine in bfloat16 generating, bf16 training, no replay), timed from `on_step_begin` to
`on_step_end` by bench/trl_replay.py's clock, in a process of its own too. The machine's load
average is recorded beside every row: on a shared machine the seconds are upper bounds.
Writes bench/results/smollm2_step.json and prints the table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PARTS = ("time_generation", "time_retrieval", "time_scoring", "time_selection", "time_update")
CONFIG = "configs/smollm2-cpu.yaml"
TRL_CONFIG = "configs/trl/smollm2-cpu.yaml"
HDR = str(Path(sys.executable).with_name("hdr"))

# row -> the settings it adds to the row above (cumulative)
LEVERS: dict[str, list[str]] = {
    "baseline": [
        "generation.backend=hf", "generation.dtype=float32", "model.compute_dtype=float32",
        "model.train_layers=null", "grpo.skip_zero_advantage=false",
    ],
    "+ vllm": ["generation.backend=vllm", "generation.max_model_len=1024"],
    "+ bf16": ["generation.dtype=bfloat16", "model.compute_dtype=bfloat16"],
    "+ top 4 layers": ["model.train_layers=4"],
    "+ skip zero-advantage": ["grpo.skip_zero_advantage=true"],
}  # fmt: skip


def hdr_row(model: str, steps: int, settings: list[str], out: Path) -> dict:
    """A short `hdr train` with `settings` (they override the bench's own); its per-step
    records."""
    command = [HDR, "train", "--config", CONFIG, f"model.path={model}", f"steps={steps}",
               f"out_dir={out}", "eval.every=0", "eval.at_start=false",
               "checkpoint.save_every=0", "log.tensorboard=false", "log.progress=false",
               *settings]  # fmt: skip
    run(command, out.with_suffix(".log"))
    return {"records": records(out)}


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(command: list[str], log: Path) -> None:
    # every row on all the cores (bench/trl_replay.py, imported by the TRL row, would
    # otherwise default it to one thread)
    threads = str(os.cpu_count())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": threads}  # fmt: skip
    with log.open("w") as fh:
        done = subprocess.run(command, stdout=fh, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = log.read_text()[-2000:]
        raise SystemExit(f"{' '.join(command[:3])} failed ({done.returncode}):\n{tail}")


def trl_row(model: str, steps: int, out: Path) -> dict:
    """TRL's GRPOTrainer (no replay) in a process of its own (`--trl-only`)."""
    result = out.with_suffix(".json")
    command = [sys.executable, __file__, "--trl-only", str(result), "--model", model,
               "--steps", str(steps)]  # fmt: skip
    run(command, out.with_suffix(".log"))
    return json.loads(result.read_text())


def trl_only(model: str, steps: int, result: Path) -> None:
    """Runs in the child process: TRL's own step times (bench/trl_replay.py's clock)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from trl_replay import trl_run

    from core.config import load_config
    from trainer.integrations.trl_run import TRLRunConfig

    config = load_config(TRLRunConfig, TRL_CONFIG, [f"model={model}"])
    config = config.model_copy(update={"trl": {**config.trl, "max_steps": steps}})
    with tempfile.TemporaryDirectory(prefix="hdr-trl-step-") as out:
        timed = trl_run(config, None, Path(out))
    result.write_text(json.dumps({"step_s": timed["step_s"]}))


# groups entering the buffer per step, at least (1.7 in the 80-step run of docs/results.md)
FILL_PER_STEP = 1.4


def full_buffer_steps(capacity: int) -> int:
    """Steps of a run that fills a `capacity` buffer."""
    return math.ceil(capacity / FILL_PER_STEP)


def full_buffer_records(records: list[dict], capacity: int, last: int) -> list[dict]:
    """The `last` steps, each of which scanned a full buffer (the step before it left
    `capacity` groups)."""
    full = [r for before, r in itertools.pairwise(records) if before["buffer_size"] >= capacity]
    if len(full) < last or full[-last:] != records[-last:]:
        raise SystemExit(
            f"capacity {capacity}: the last {last} steps did not all scan a full buffer"
            f" ({len(full)} steps did): run more steps (--total-steps)"
        )
    return records[-last:]


def summarize(
    name: str, row: dict, skip: int, load: tuple[float, float], full: tuple[int, int] | None = None
) -> dict:
    """Medians of the parts and the step over the steps after `skip`, or, with `full` =
    (capacity, last), over the last steps, which scanned a full buffer."""
    out: dict = {"row": name, "load_before": load[0], "load_after": load[1]}
    if "records" in row:
        if full is None:
            kept = row["records"][skip:]
        else:
            kept = full_buffer_records(row["records"], *full)
            out["capacity"], out["measured_steps"] = full[0], [r["step"] for r in kept]
            out["replay_ages"] = [age for r in kept for age in r.get("replay_ages", [])]
        out["step_s"] = statistics.median(r["time_step"] for r in kept)
        for part in PARTS:
            out[part.removeprefix("time_") + "_s"] = statistics.median(r[part] for r in kept)
        out["replayed_groups"] = statistics.mean(r["replayed_groups"] for r in kept)
        out["scanned_groups"] = statistics.mean(r["scanned_groups"] for r in kept)
        if full is not None:
            out.update(rescoring_against_fresh(kept))
        out["steps_s"] = [round(r["time_step"], 2) for r in row["records"]]
    else:
        out["step_s"] = statistics.median(row["step_s"][skip:])
        out["steps_s"] = [round(s, 2) for s in row["step_s"]]
    return out


def rescoring_against_fresh(records: list[dict]) -> dict:
    """What one stored group costs to re-score (the scan's seconds over the groups it scored)
    against what one fresh group costs to produce (generation, retrieval and behaviour
    scoring over the fresh groups), summed over `records`; and the frozen-bottom tokens the
    scan forwarded (0: it ran the top layers on kept bottom states)."""
    scanned = sum(r["cost_scanned_groups"] for r in records)
    fresh = sum(r["cost_fresh_groups"] for r in records)
    fresh_s = sum(r["time_generation"] + r["time_retrieval"] + r["time_scoring"] for r in records)
    rescore = sum(r["time_selection"] for r in records) / scanned if scanned else None
    per_fresh = fresh_s / fresh
    return {
        "rescore_s_per_group": rescore,
        "fresh_s_per_group": per_fresh,
        "rescore_over_fresh": rescore / per_fresh if rescore is not None else None,
        "bottom_tokens_selection": sum(r.get("bottom_tokens_selection", 0) for r in records),
    }


def table(rows: list[dict]) -> str:
    heads = ["row", "step s", "generation", "retrieval", "scoring", "scan", "update",
             "replayed", "scanned", "re-score / fresh", "x TRL", "load"]  # fmt: skip
    trl = next((r["step_s"] for r in rows if r["row"] == "trl"), None)
    lines = ["| " + " | ".join(heads) + " |", "|" + " --- |" * len(heads)]
    for r in rows:
        cells = [r["row"], f"{r['step_s']:.1f}"]
        for part in ("generation_s", "retrieval_s", "scoring_s", "selection_s", "update_s"):
            cells.append(f"{r[part]:.1f}" if part in r else "")
        cells.append(f"{r['replayed_groups']:.1f}" if "replayed_groups" in r else "")
        cells.append(f"{r['scanned_groups']:.1f}" if "scanned_groups" in r else "")
        ratio = r.get("rescore_over_fresh")
        cells.append(f"{ratio:.3f}" if ratio is not None else "")
        cells.append(f"{r['step_s'] / trl:.2f}" if trl else "")
        cells.append(f"{r['load_before']:.1f}-{r['load_after']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="data/smollm2-sft", help="The policy (an SFT start).")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--skip", type=int, default=1, help="First steps left out (buffer fills).")
    ap.add_argument("--rows", default=",".join([*LEVERS, "trl"]), help="Rows to run, in order.")
    ap.add_argument(
        "--full-buffer",
        help="Capacities (comma-separated) to time hdr's path at with the buffer full;"
        " --steps is then the number of last steps measured, each with the buffer full.",
    )
    ap.add_argument(
        "--total-steps", type=int,
        help="Steps of the shared run every --full-buffer row resumes (default: enough to fill"
        " the largest capacity).",
    )  # fmt: skip
    ap.add_argument(
        "--shared",
        type=Path,
        help="--full-buffer: keep the shared run in this folder, or reuse the one kept there"
        " with the same model, length and settings.",
    )
    ap.add_argument("--trl", action="store_true", help="--full-buffer: TRL's row too.")
    ap.add_argument(
        "--trl-steps", type=int, default=4,
        help="--full-buffer: TRL's steps, the first left out (its process grows each step on"
        " the CPU: 20 GB after 4, killed for memory on a 24 GB machine during its 5th).",
    )  # fmt: skip
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="A TrainConfig setting added to every hdr row (repeatable).",
    )  # fmt: skip
    ap.add_argument("--out", help="The JSON (default: bench/results/smollm2_step.json, or"
                    " smollm2_full_buffer.json with --full-buffer).")  # fmt: skip
    ap.add_argument("--trl-only", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_only:
        return trl_only(args.model, args.steps, args.trl_only)
    if args.full_buffer is not None:  # "" with --trl: TRL's row alone, into the same JSON
        capacities = sorted({int(c) for c in args.full_buffer.split(",") if c}, reverse=True)
        out = args.out or "bench/results/smollm2_full_buffer.json"
        keep = lambda row: write_report(args, merged_rows(out, [row]), out)  # noqa: E731
        if capacities:
            with tempfile.TemporaryDirectory(prefix="hdr-smollm2-full-") as tmp:
                length = args.total_steps or full_buffer_steps(capacities[0])
                where = args.shared or Path(tmp) / "shared"
                shared = shared_run(args.model, capacities[0], length, args.set, where)
                for capacity in capacities:  # each row written as it ends
                    keep(full_buffer_row(shared, capacity, args.steps, Path(tmp)))
        if args.trl:
            keep(timed_trl_row(args.model, args.trl_steps, args.skip))
        return None
    wanted = args.rows.split(",")
    unknown = [r for r in wanted if r not in LEVERS and r != "trl"]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; valid: {', '.join([*LEVERS, 'trl'])}")
    rows, settings = [], []
    with tempfile.TemporaryDirectory(prefix="hdr-smollm2-step-") as tmp:
        for name in [*LEVERS, "trl"]:
            if name != "trl":
                settings += LEVERS[name]
            if name not in wanted:
                continue
            out = Path(tmp) / name.replace(" ", "_").replace("+", "plus")
            before = os.getloadavg()[0]
            started = time.perf_counter()
            if name == "trl":
                row = trl_row(args.model, args.steps, out)
            else:
                row = hdr_row(args.model, args.steps, [*settings, *args.set], out)
            summary = summarize(name, row, args.skip, (before, os.getloadavg()[0]))
            summary["wall_s"] = round(time.perf_counter() - started, 1)
            summary["settings"] = list(settings) if name != "trl" else [TRL_CONFIG]
            rows.append(summary)
            print(f"{name}: step {summary['step_s']:.1f} s", flush=True)
    write_report(args, rows, args.out or "bench/results/smollm2_step.json")


@dataclass(frozen=True)
class SharedRun:
    """The run every full-buffer row resumes a copy of: its folder, length, seconds and
    settings."""

    run_dir: Path
    steps: int
    wall_s: float
    settings: list[str]


SHARED_RECORD = "bench_shared_run.json"


def shared_run(model: str, capacity: int, steps: int, extra: list[str], out: Path) -> SharedRun:
    """hdr's path (every lever, then `extra`) at `capacity` for `steps` steps in `out`,
    checkpointed at the last; refused in one line unless it filled its buffer. A run kept in
    `out` by an earlier call with the same model, length and settings is reused; one made
    otherwise is refused, and so is a folder this bench did not write."""
    settings = [*(s for lever in LEVERS.values() for s in lever), *extra]
    this_run = [*settings, f"replay.capacity={capacity}", f"checkpoint.save_every={steps}"]
    made = {"model": model, "steps": steps, "settings": this_run}
    record = out / SHARED_RECORD
    if record.is_file():
        kept = json.loads(record.read_text())
        if {k: kept.get(k) for k in made} != made:
            raise SystemExit(f"{out}: a shared run made with other settings ({record}); name"
                             " another folder")  # fmt: skip
        print(f"shared run: reused from {out} ({steps} steps)", flush=True)
        return SharedRun(out, steps, kept["wall_s"], settings)
    if out.exists():
        raise SystemExit(f"{out} exists and holds no shared run of this bench; name another folder")
    started = time.perf_counter()
    done = hdr_row(model, steps, this_run, out)["records"]
    if done[-1]["buffer_size"] < capacity:
        raise SystemExit(
            f"the shared run left {done[-1]['buffer_size']} groups after {steps} steps, fewer"
            f" than the largest capacity {capacity}: run more steps (--total-steps)"
        )
    wall_s = round(time.perf_counter() - started, 1)
    record.write_text(json.dumps({**made, "wall_s": wall_s}, indent=2) + "\n")
    print(f"shared run: {steps} steps, buffer {capacity} full", flush=True)
    return SharedRun(out, steps, wall_s, settings)


def full_buffer_row(shared: SharedRun, capacity: int, last: int, tmp: Path) -> dict:
    """A copy of the shared run resumed at `capacity` for 1 + `last` steps, timed over the
    `last`, each of which scanned a full buffer."""
    name = f"full buffer, capacity {capacity}"
    run_dir = tmp / f"capacity_{capacity}"
    shutil.copytree(shared.run_dir, run_dir)
    before = os.getloadavg()[0]
    started = time.perf_counter()
    command = [HDR, "train", "--resume", str(run_dir), f"steps={shared.steps + 1 + last}",
               f"replay.capacity={capacity}"]  # fmt: skip
    run(command, run_dir.with_suffix(".log"))
    row = {"records": records(run_dir)}
    summary = summarize(name, row, 0, (before, os.getloadavg()[0]), (capacity, last))
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    summary["shared_run"] = {"steps": shared.steps, "wall_s": shared.wall_s}
    summary["settings"] = [*shared.settings, f"replay.capacity={capacity}"]
    summary["command"] = "bench/smollm2_step.py " + " ".join(sys.argv[1:])
    print(f"{name}: step {summary['step_s']:.1f} s", flush=True)
    return summary


def timed_trl_row(model: str, steps: int, skip: int) -> dict:
    """TRL's row (no replay, so no buffer to fill), timed like the others. Its colocated vLLM
    engine and full fine-tune hold about 17 GB after its first steps and grow each step: on a
    24 GB machine nothing else large may run beside it (a paused process keeps its memory)."""
    with tempfile.TemporaryDirectory(prefix="hdr-smollm2-trl-") as tmp:
        before = os.getloadavg()[0]
        started = time.perf_counter()
        row = trl_row(model, steps, Path(tmp) / "trl")
        summary = summarize("trl", row, skip, (before, os.getloadavg()[0]))
    summary["command"] = "bench/smollm2_step.py " + " ".join(sys.argv[1:])
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    summary["settings"] = [TRL_CONFIG]
    print(f"trl: step {summary['step_s']:.1f} s", flush=True)
    return summary


def merged_rows(out: str, rows: list[dict]) -> list[dict]:
    """`rows` in place of the rows of the same name in the JSON at `out`, the others kept."""
    path = Path(out)
    earlier = json.loads(path.read_text())["rows"] if path.exists() else []
    names = {r["row"] for r in rows}
    kept = [r for r in earlier if r["row"] not in names]
    return sorted([*kept, *rows], key=lambda r: -r.get("capacity", 0))


def write_report(args, rows: list[dict], out: str) -> None:
    report = {
        "command": "bench/smollm2_step.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "config": CONFIG,
        "steps": args.steps,
        "skipped_steps": args.skip,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },
        "rows": rows,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    print(table(rows))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
