"""Asynchronous rollout against the synchronous loop, at emulated search latencies.

    .venv/bin/python bench/async_rollout.py --steps 8 --repeats 3 --latencies 0 50 500

Self-contained: it writes a small corpus (300 vital articles), a BM25 index over it, the QA
task made from it, the tiny policy and a short SFT of it into `--work` (reused when there),
then for each latency starts a real `hdr serve` with `emulated_cost.request_latency_ms` set
(added to every /retrieve request) and trains the same seed with:

- `sync`: the synchronous loop as a user runs it, rollouts in the trainer's process, one
  rollout call a step (`distributed.rollout_shards=1`: one search request a turn);
- `sync_concurrent`: `--workers` rollout workers with the queue bound 0 and
  `async_rollout.split=shards` (`rollout_shards` = workers): still synchronous (every rollout
  waits for the last update) but each step's shards roll out in parallel, so it issues as many
  concurrent retrieval requests as the asynchronous runs do;
- one asynchronous run per staleness rule (`version_bound`, `drift_gate`,
  `adaptive_drift_gate`), `--workers` workers taking whole steps in turn
  (`async_rollout.split=steps`, one rollout call a step), `max_lag` `--max-lag`.

The machine is shared, so the arms are interleaved: each repeat runs every arm once (the
order rotated from one repeat to the next) and the table gives each arm's median over the
repeats, with the machine's load beside it. `speedup_vs_sync` is the median groups/s over
the better of the two synchronous loops' medians (so overlap, not extra parallelism, is what
it measures). groups/s are fresh groups over the wall time of all the steps, the first
included: the workers' first rollouts start when the trainer's clock does (each reports ready
before its first rollout), so the rollouts an asynchronous run makes ahead during step 1 are
paid for inside the window; the workers' start-up, seconds of imports, is left out of every
run. `groups_per_s_from_step_2` (the previous rounds' figure) leaves step 1 out and so
credits an asynchronous run with the rollouts it made during step 1. `cpu_cores` is the
trainer's and its workers' process CPU seconds over the steps from step 2 on per wall second
(the server not counted); `machine_busy_cores` is the whole machine's busy CPU (every
process, ours included) over the whole run, start-up included, from /proc/stat: with ours
near 0.3 cores, the rest of it is the other work on the machine.

Where the time goes (medians of per-step seconds, from step 2 on): `t_wait_rollout` (the
trainer waiting for the step's rollout: all of the rollout in the synchronous loop),
`t_train` (scoring with the gate's teacher-forced pass, selection and the update),
`t_publish` (copying the new weights out), and per worker rollout `w_wait_version`,
`w_load_weights`, `w_rollout` (its generation and search), `w_cpu_share` (its CPU over its
wall time).

Held-out scores (Mean@k, Best@k, greedy EM on `--eval-questions` questions after the last
step) are reported, but a tiny policy trained a few steps cannot show a quality difference:
quality claims are untestable on this bed.

Then one setting where staleness hurts: a high learning rate (`--high-lr`), latency 0,
`max_lag` 2: `version_bound` admits every late group; `drift_gate` rejects those whose drift
is over tau; the rows give the drift of the late groups each admitted and rejected.

Writes bench/results/async.json and prints the table. Target (in the bench, not a test): at
500 ms a call, speedup_vs_sync >= 1.5.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
TARGET = 1.5
RULES = ("version_bound", "drift_gate", "adaptive_drift_gate")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare(work: Path) -> dict[str, Path]:
    """Corpus, BM25 index, QA task, tiny policy and its SFT under `work` (kept for reuse)."""
    from collections import Counter

    from models.tiny import TinyPolicyConfig, init_tiny_policy, vital_corpus_texts
    from retrieval_server.index.build import build_index
    from retrieval_server.index.corpus import article_contents, iter_vital_articles, write_corpus

    work.mkdir(parents=True, exist_ok=True)
    paths = {k: work / v for k, v in
             {"corpus": "corpus.jsonl", "index": "index", "qa": "qa.jsonl",
              "policy": "policy", "sft": "sft"}.items()}  # fmt: skip
    articles = list(itertools.islice(iter_vital_articles(), 300))
    if not paths["corpus"].exists():
        write_corpus(paths["corpus"], [article_contents(a) for a in articles])
    if not (paths["index"] / "manifest.json").exists():
        build_index(paths["corpus"], paths["index"], bm25=True, dense=False, show_progress=False)
    if not paths["qa"].exists():
        counts = Counter(a.description.strip() for a in articles)
        with paths["qa"].open("w") as f:
            for i, a in enumerate(articles):
                q = a.description.strip()
                if q and counts[q] == 1:
                    f.write(json.dumps({"id": str(i), "question": q, "golden_answers": [a.title]}))
                    f.write("\n")
    if not (paths["policy"] / "config.json").exists():
        config = TinyPolicyConfig(
            vocab_size=600, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
        )
        init_tiny_policy(paths["policy"], vital_corpus_texts(limit=300), config)
    return paths


def overrides(paths, url: str, out: Path, steps: int, eval_questions: int) -> list[str]:
    return [
        f"retrieval.urls=[{url}]", "retrieval.retriever=bm25", f"model.path={paths['sft']}",
        f"data.train={paths['qa']}", f"data.eval={paths['qa']}", f"out_dir={out}",
        f"steps={steps}", "grpo.batch_prompts=8", "grpo.group_size=4", "grpo.warmup_steps=1",
        "grpo.lr=1e-3", "grpo.micro_batch=16", "replay.budget=2", "replay.capacity=16",
        "replay.tau=1.0", "rollout.max_tokens_per_turn=16", "rollout.reward=f1",
        "rollout.format_weight=0.5", f"eval.every={steps}", "eval.at_start=false",
        f"eval.num_questions={eval_questions}", "eval.k=2", "checkpoint.save_every=0",
        "log.progress=false", "log.tensorboard=false", "sft.eval_questions=0",
    ]  # fmt: skip


def sft(paths, url: str) -> None:
    from core.config import load_config
    from trainer.config import TrainConfig
    from trainer.tools.sft import run_sft

    if (paths["sft"] / "config.json").exists():
        return
    base = overrides(paths, url, paths["sft"].with_name("sft-unused"), 2, 4)
    extra = [f"sft.init_model={paths['policy']}", "sft.epochs=4", "sft.lr=5e-3"]
    cfg = load_config(TrainConfig, REPO / "configs/tiny-cpu.yaml", [*base, *extra])
    run_sft(cfg)


def serve(index: Path, port: int, latency_ms: float) -> subprocess.Popen:
    command = [sys.executable, "-m", "hdr", "serve", "--index", str(index), "--port", str(port),
               "--retriever", "bm25", f"emulated_cost.request_latency_ms={latency_ms}"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("hdr serve did not start")


def machine_cpu() -> float:
    """Busy CPU seconds of the whole machine so far (every process), from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def train_once(base: list[str], extra: list[str]) -> tuple[list[dict], dict | None, dict]:
    from core.config import load_config
    from trainer.config import TrainConfig
    from trainer.loop import train

    cfg = load_config(TrainConfig, REPO / "configs/tiny-cpu.yaml", [*base, *extra])
    shutil.rmtree(cfg.out_dir, ignore_errors=True)
    busy, started, load = machine_cpu(), time.monotonic(), load_average()
    run_dir = train(cfg)
    busy_end = machine_cpu()
    machine = {
        "machine_busy_cores": (busy_end - busy) / (time.monotonic() - started),
        "load_1min_start": load,
        "load_1min_end": load_average(),
    }
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    return rows, (evals[-1] if evals else None), machine


def median_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarise(name: str, latency: float, rows: list[dict], heldout, machine: dict) -> dict:
    steady = rows[1:] or rows
    wall = sum(r["time_step"] for r in steady)
    groups = sum(r["cost_fresh_groups"] for r in steady)
    wall_all = sum(r["time_step"] for r in rows)
    groups_all = sum(r["cost_fresh_groups"] for r in rows)
    lags = [lag for r in rows for lag in r.get("rollout_lags", [])]
    late = sum(r.get("late_groups", 0) for r in rows)
    admitted = sum(r.get("late_admitted", 0) for r in rows)
    drift_in = [d for r in rows for d in r.get("late_admitted_drift", [])]
    every = [d for r in rows for d in r.get("late_drift", [])]
    drift_out = list(every)
    for d in drift_in:
        drift_out.remove(d)
    trainer_cpu = sum(v for r in steady for k, v in r.items() if k.startswith("cost_cpu_"))
    worker_cpu = sum(r.get("worker_cpu_s", 0.0) for r in steady)
    for r in steady:
        r["t_train"] = r["time_scoring"] + r["time_selection"] + r["time_update"]
        r["t_wait_rollout"] = r.get("time_wait_rollout", r["time_generation"] + r["time_retrieval"])
        if "worker_rollout_s" in r:
            r["w_cpu_share"] = r["worker_cpu_s"] / max(
                r["worker_wait_version_s"] + r["worker_load_weights_s"] + r["worker_rollout_s"],
                1e-9,
            )
    return {
        "rule": name,
        "search_latency_ms": latency,
        "steps": len(rows),
        "groups_per_s": groups_all / wall_all if wall_all else 0.0,
        "steps_per_s": len(rows) / wall_all if wall_all else 0.0,
        "groups_per_s_from_step_2": groups / wall if wall else 0.0,
        "cpu_cores": (trainer_cpu + worker_cpu) / wall if wall else 0.0,
        "trainer_cpu_cores": trainer_cpu / wall if wall else 0.0,
        **machine,
        "t_step": median_of(steady, "time_step"),
        "t_wait_rollout": median_of(steady, "t_wait_rollout"),
        "t_train": median_of(steady, "t_train"),
        "t_publish": median_of(steady, "time_publish"),
        "w_wait_version": median_of(steady, "worker_wait_version_s"),
        "w_load_weights": median_of(steady, "worker_load_weights_s"),
        "w_rollout": median_of(steady, "worker_rollout_s"),
        "w_cpu_share": median_of(steady, "w_cpu_share"),
        "t_generation": median_of(steady, "time_generation"),
        "t_retrieval": median_of(steady, "time_retrieval"),
        "mean_lag": statistics.fmean(lags) if lags else 0.0,
        "late_groups": late,
        "admitted_late_share": admitted / late if late else None,
        "late_drift_admitted_p50": statistics.median(drift_in) if drift_in else None,
        "late_drift_rejected_p50": statistics.median(drift_out) if drift_out else None,
        "final_tau": rows[-1].get("staleness_tau"),
        "loss_last": rows[-1]["loss"],
        "heldout_mean_at_k": heldout["mean_at_k"] if heldout else None,
        "heldout_best_at_k": heldout["best_at_k"] if heldout else None,
        "heldout_greedy_em": heldout["greedy_em"] if heldout else None,
    }


def medians(name: str, latency: float, repeats: list[dict]) -> dict:
    """One arm's row: the median of every number over its repeats (groups/s of each repeat
    kept beside it)."""
    row: dict = {"rule": name, "search_latency_ms": latency, "repeats": len(repeats)}
    for key, value in repeats[0].items():
        if key in row or not (isinstance(value, float | int) or value is None):
            continue
        row[key] = median_of(repeats, key)
    row["groups_per_s_each"] = [r["groups_per_s"] for r in repeats]
    return row


def runs_for(args) -> list[tuple[str, list[str]]]:
    """The runs at one latency: both synchronous loops, then one asynchronous run per rule.
    Every process gets one torch thread (trainer: `--trainer-threads`): more threads than
    cores over all processes makes OpenMP's waiting threads slow everything down."""
    w = args.workers
    workers = [f"async_rollout.workers={w}", "async_rollout.worker_threads=1"]
    out = [
        ("sync", ["distributed.rollout_shards=1"]),
        ("sync_concurrent", [*workers, f"distributed.rollout_shards={w}",
                             "async_rollout.split=shards", "async_rollout.max_lag=0"]),
    ]  # fmt: skip
    for rule in RULES:
        out.append((rule, [*workers, "distributed.rollout_shards=1", "async_rollout.split=steps",
                           f"async_rollout.max_lag={args.max_lag}",
                           f"async_rollout.rule={rule}", f"async_rollout.tau={args.tau}",
                           "async_rollout.adaptive_gate.target=0.5"]))  # fmt: skip
    return out


def staleness_hurts(paths, url: str, work: Path, args, rule: str) -> dict:
    """`rule` at a high learning rate with `max_lag` 2: what it admits, and at what drift."""
    base = overrides(paths, url, work / f"hurt-{rule}", args.steps, args.eval_questions)
    w = args.workers
    extra = [f"grpo.lr={args.high_lr}", f"distributed.rollout_shards={w}",
             f"async_rollout.workers={w}", "async_rollout.max_lag=2",
             "async_rollout.worker_threads=1",
             f"async_rollout.rule={rule}", f"async_rollout.tau={args.tau}"]  # fmt: skip
    rows, heldout, machine = train_once(base, extra)
    return {**summarise(rule, 0.0, rows, heldout, machine), "lr": args.high_lr}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every arm")
    ap.add_argument("--latencies", type=float, nargs="+", default=[0, 50, 500])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-lag", type=int, default=1, help="the asynchronous runs' queue bound")
    ap.add_argument("--tau", type=float, default=1e-3, help="drift_gate's tau (adaptive: start)")
    ap.add_argument("--high-lr", type=float, default=2e-2)
    ap.add_argument("--no-hurt", action="store_true", help="skip the high-lr runs")
    ap.add_argument("--eval-questions", type=int, default=16)
    ap.add_argument("--trainer-threads", type=int, default=1, help="torch threads, trainer")
    ap.add_argument("--work", default="/tmp/hdr-async-bench")
    ap.add_argument("--out", default=str(REPO / "bench/results/async.json"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.trainer_threads)  # workers: 1 each (runs_for)
    work = Path(args.work)
    paths = prepare(work)
    results, hurt, each = [], [], []
    for latency in args.latencies:
        port = free_port()
        server = serve(paths["index"], port, latency)
        url = f"http://127.0.0.1:{port}"
        try:
            sft(paths, url)
            arms = runs_for(args)
            done: dict[str, list[dict]] = {name: [] for name, _ in arms}
            for rep in range(args.repeats):
                for name, extra in arms[rep % len(arms) :] + arms[: rep % len(arms)]:
                    out = work / f"run-{name}"
                    base = overrides(paths, url, out, args.steps, args.eval_questions)
                    rows, heldout, machine = train_once(base, extra)
                    done[name].append(summarise(name, latency, rows, heldout, machine))
                    each.append({**done[name][-1], "repeat": rep})
                    print(f"{latency:g} ms, repeat {rep}, {name}: "
                          f"{done[name][-1]['groups_per_s']:.2f} groups/s, machine busy "
                          f"{machine['machine_busy_cores']:.2f} cores", flush=True)  # fmt: skip
            rows_here = [medians(name, latency, done[name]) for name, _ in arms]
            best_sync = max(r["groups_per_s"] for r in rows_here[:2])
            for r in rows_here:
                r["speedup_vs_sync"] = r["groups_per_s"] / best_sync if best_sync else None
            results += rows_here
            if latency == args.latencies[0] and not args.no_hurt:
                hurt = [staleness_hurts(paths, url, work, args, rule)
                        for rule in ("version_bound", "drift_gate")]  # fmt: skip
        finally:
            server.terminate()
            server.wait(timeout=30)
    report = {
        "command": "python bench/async_rollout.py " + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPU cores, shared with other work while measured"
        " (machine_busy_cores and load_1min_* in each row)",
        "steps": args.steps, "repeats": args.repeats, "workers": args.workers,
        "max_lag": args.max_lag, "trainer_threads": args.trainer_threads,
        "batch": "b=8, G=4, 1 search turn",
        "target": f"speedup_vs_sync >= {TARGET} at 500 ms a call",
        "quality": "untestable on this bed (tiny policy, a few steps,"
        f" {args.eval_questions} held-out questions)",
        "rows": results, "staleness_hurts": hurt, "each_run": each,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print_table(results, hurt)


def fmt(v, digits=3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def print_table(results: list[dict], hurt: list[dict]) -> None:
    console = Console(width=240)
    speed = ("rule", "search_latency_ms", "groups_per_s", "speedup_vs_sync", "cpu_cores",
             "machine_busy_cores", "mean_lag", "admitted_late_share", "late_drift_admitted_p50",
             "late_drift_rejected_p50", "heldout_mean_at_k", "heldout_greedy_em")  # fmt: skip
    times = ("rule", "search_latency_ms", "t_step", "t_wait_rollout", "t_train", "t_publish",
             "w_wait_version", "w_load_weights", "w_rollout", "w_cpu_share")  # fmt: skip
    tables = (("asynchronous rollout (medians over repeats)", results, speed),
              ("where a step's time goes (median seconds)", results, times),
              ("high lr, max_lag 2", hurt, speed))  # fmt: skip
    for title, rows, cols in tables:
        if not rows:
            continue
        table = Table(title=title)
        for c in cols:
            table.add_column(c)
        for r in rows:
            table.add_row(*(fmt(r.get(c)) for c in cols))
        console.print(table)


if __name__ == "__main__":
    main()
