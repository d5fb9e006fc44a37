"""`hdr experiment`: every replay arm trained and evaluated side by side, on the CPU.

What it does, end to end, on the embedded defaults:

1. data: the wiki-vital corpus and its index under `--data` (built with `hdr index
   prepare-wiki` / `hdr index build` when missing);
2. a real `hdr serve` subprocess on a free loopback port over that index, stopped at the end;
3. one SFT start (`hdr sft`'s `run_sft`), cached under `--data`, shared by every arm;
4. each arm x seed is `trainer.loop.train(config)` with dotted overrides on the base config
   (`configs/tiny-cpu.yaml`): same SFT start, same seeds (so the same prompt order), same
   periodic held-out subset;
5. each final model is evaluated by `evaluation.evaluate` on one fixed held-out set of
   wiki-vital test questions, identical for every arm and seed (and the SFT start once);
6. results: per arm Mean@k, Best@k, greedy EM (mean and spread over seeds), differences to
   the reference arms paired on the same questions with standard errors, env calls, wall
   time and its split, mean step time; `results.json`, `results.md` and the charts of
   `evaluation.plots` in the out dir.

The arms (paper's role-aligned baselines, Search-R1 setting): `on_policy` (b fresh groups per
step), `on_policy_larger` (1.5b fresh: more environment cost), `replay_recency` (b fresh + r
replayed, the r newest, no gate) and `headroom_drift` (b + r, headroom order, L2 drift gate);
with `--ablations`: `headroom_only`, `drift_only`, `headroom_drift_l1`, against
`headroom_drift`. r = b/2, so the replay arms update on as many groups as on_policy_larger
while rolling out as few as on_policy.

Departures from the paper: a tiny policy and the embedded wiki-vital task instead of
Qwen2.5-3B on NQ+HotpotQA; a few hundred held-out questions and k of 5, not seven benchmarks
at k=32; two or three seeds. The L1 gate's threshold is sqrt(tau) of the L2 gate's (by
Jensen, mean|d| <= sqrt(mean d^2), so it is at least as permissive), not separately
calibrated. Everything is resumable: a finished run (its `final/` and held-out `eval.json`)
is reused when the command is run again with the same out dir.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from evaluation.metrics import (
    markdown_table,
    mean_spread,
    paired_difference,
    write_json_atomic,
    write_text_atomic,
)
from hdr.config import StrictModel
from hdr.errors import UserError
from hdr.registry import Registry

# --------------------------------------------------------------------------------- arms


@dataclass(frozen=True)
class Arm:
    """One comparison arm: a replay selector and how much fresh and replayed data a step uses.

    `fresh` is a multiple of the base b (`grpo.batch_prompts`); `replays` says whether the arm
    gets the replay budget r. `overrides` are extra dotted overrides.
    """

    name: str
    selector: str
    fresh: float = 1.0
    replays: bool = True
    overrides: tuple[str, ...] = ()
    doc: str = ""


ARMS: Registry[Arm] = Registry("experiment arm")


def _add(arm: Arm) -> None:
    ARMS.register(arm.name)(arm)


_add(Arm("on_policy", "on_policy", replays=False, doc="b fresh groups, no replay"))
_add(Arm("on_policy_larger", "on_policy", 1.5, replays=False, doc="1.5b fresh groups"))
_add(Arm("replay_recency", "replay_recency", doc="b fresh + the r newest stored groups"))
_add(Arm("headroom_drift", "headroom_drift", doc="b fresh + r by headroom, L2 drift gate"))
_add(Arm("headroom_only", "headroom_only", doc="b fresh + r by headroom, no gate"))
_add(Arm("drift_only", "drift_only", doc="b fresh + r newest passing the L2 drift gate"))
_add(Arm("headroom_drift_l1", "headroom_drift_l1", doc="b fresh + r by headroom, L1 gate"))

MAIN_ARMS = ("on_policy", "on_policy_larger", "replay_recency", "headroom_drift")
MAIN_REFERENCES = ("on_policy_larger", "replay_recency")
ABLATION_ARMS = ("headroom_drift", "headroom_only", "drift_only", "headroom_drift_l1")
ABLATION_REFERENCES = ("headroom_drift",)
SFT_START = "sft_start"


class ExperimentConfig(StrictModel):
    """The experiment's knobs; `--quick` and `--ablations` are presets of these."""

    base_config: str = Field("configs/tiny-cpu.yaml", description="TrainConfig YAML of every arm.")
    data_dir: str = Field("data", description="Corpus, index and the cached SFT start.")
    out_dir: str = Field("runs/experiment", description="Runs, evaluations, results, charts.")
    arms: list[str] = Field(list(MAIN_ARMS), description="Arms to train, in table order.")
    references: list[str] = Field(
        list(MAIN_REFERENCES), description="Arms every other arm is compared with (paired)."
    )
    seeds: list[int] = Field([1, 2], min_length=1, description="Training seeds of every arm.")
    steps: int = Field(60, ge=1, description="Training steps per run.")
    batch_prompts: int = Field(8, ge=2, description="b: fresh prompts per step.")
    group_size: int = Field(5, ge=2, description="G: responses per prompt.")
    replay_ratio: float = Field(0.5, gt=0, description="r = round(ratio * b) replayed groups.")
    lr: float = Field(5e-5, gt=0, description="GRPO learning rate (cpu-bed: 3e-5 to 1e-4).")
    tau: float | None = Field(None, gt=0, description="L2 drift gate; None: the base config's.")
    eval_every: int = Field(15, ge=0, description="Periodic held-out eval (eval.jsonl) interval.")
    eval_num_questions: int = Field(48, ge=1, description="Periodic held-out subset size.")
    eval_k: int = Field(4, ge=1, description="Samples per question in the periodic eval.")
    final_questions: int | None = Field(
        500,
        ge=1,
        description="Final held-out questions (a fixed set); None: the whole test split.",
    )
    final_k: int = Field(5, ge=1, description="Samples per question in the final evaluation.")
    sft_epochs: int | None = Field(None, ge=1, description="SFT epochs; None: base config's.")
    sft_max_examples: int | None = Field(None, ge=1, description="SFT questions; None: all.")
    corpus_limit: int | None = Field(None, ge=1, description="Index only the first N articles.")
    retriever: str = Field("bm25", description="Retriever the server and rollouts use.")
    train_overrides: list[str] = Field([], description="Extra dotted overrides for every run.")
    jobs: int = Field(
        2, ge=1, description="Runs trained at once, each in its own process with cpu/jobs threads."
    )
    progress: bool = Field(True, description="Progress bars on stderr (only with jobs=1).")

    @property
    def replay_budget(self) -> int:
        return max(1, round(self.replay_ratio * self.batch_prompts))


QUICK = {
    "steps": 3,
    "batch_prompts": 4,
    "group_size": 3,
    "eval_every": 3,
    "eval_num_questions": 4,
    "eval_k": 2,
    "final_questions": 8,
    "final_k": 2,
    "sft_epochs": 1,
    "sft_max_examples": 128,
    "corpus_limit": 2000,
    # a barely trained policy earns no reward, so store zero-advantage groups to exercise replay
    "train_overrides": ["rollout.max_tokens_per_turn=16", "replay.store_zero_advantage=true"],
}


# `hdr demo`: the whole pipeline once, on the embedded defaults, within about 30 minutes on
# 2 cores: one headroom_drift run from the SFT start, evaluated beside the SFT start.
DEMO = {
    "arms": ["headroom_drift"],
    "references": [],
    "seeds": [1],
    "steps": 40,
    "final_questions": 300,
    "jobs": 1,
}


def experiment_config(
    quick: bool = False,
    ablations: bool = False,
    overrides: Sequence[str] = (),
    demo: bool = False,
    **fields: Any,
) -> ExperimentConfig:
    """The preset (main, ablations or demo; full or quick), then explicit fields, then `k=v`
    overrides; unknown keys and unknown arms are UserErrors."""
    from hdr.config import build_config

    data: dict[str, Any] = {}
    if ablations:
        data.update(arms=list(ABLATION_ARMS), references=list(ABLATION_REFERENCES))
    if demo:
        data.update(DEMO)
    if quick:
        data.update(QUICK)
    data.update({k: str(v) if isinstance(v, Path) else v for k, v in fields.items()})
    cfg = build_config(ExperimentConfig, data, overrides)
    for name in [*cfg.arms, *cfg.references]:
        ARMS.get(name)  # UserError listing the valid arms on a typo
    missing = [r for r in cfg.references if r not in cfg.arms]
    if missing:
        raise UserError(f"reference arms {missing} are not among the arms {cfg.arms}")
    return cfg


# ---------------------------------------------------------------------- data and server


def _hdr(*args: str, log: Path | None = None) -> None:
    """Run an `hdr` subcommand in a subprocess; a failure is a UserError with its last lines."""
    cmd = [sys.executable, "-m", "hdr.cli", *args]
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if log is not None:
        with log.open("a") as fh:
            fh.write(f"$ hdr {' '.join(args)}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise UserError(f"hdr {' '.join(args[:2])} failed: {' | '.join(tail)}")


def ensure_index(cfg: ExperimentConfig, log: Path) -> Path:
    """`<data>/index` over `<data>/wiki-vital.jsonl`, built when missing (quick: a subset)."""
    data = Path(cfg.data_dir)
    suffix = f"-{cfg.corpus_limit}" if cfg.corpus_limit else ""
    corpus, index = data / f"wiki-vital{suffix}.jsonl", data / f"index{suffix}"
    if (index / "manifest.json").is_file():
        return index
    data.mkdir(parents=True, exist_ok=True)
    if not corpus.is_file():
        print(f"experiment: preparing the corpus {corpus}", file=sys.stderr, flush=True)
        tmp = corpus.with_name(corpus.name + ".partial")
        limit = ["--limit", str(cfg.corpus_limit)] if cfg.corpus_limit else []
        _hdr("index", "prepare-wiki", "--out", str(tmp), *limit, log=log)
        os.replace(tmp, corpus)
    print(f"experiment: building the index {index}", file=sys.stderr, flush=True)
    _hdr("index", "build", "--corpus", str(corpus), "--out", str(index), log=log)
    return index


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, get SIGTERM when the parent dies, so a killed
    experiment never leaves its server behind. Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import contextlib
        import ctypes
        import signal

        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C (finally blocks run: the server is stopped)."""
    import signal

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def serve(index: Path, retriever: str, log: Path, timeout_s: float = 300.0) -> Iterator[str]:
    """A real `hdr serve` subprocess on a free loopback port; yields its URL, stops it after."""
    import httpx

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "hdr.cli",
        "serve",
        "--index",
        str(index),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--retriever",
        retriever,
        "--no-access-log",
    ]
    url = f"http://127.0.0.1:{port}"
    with log.open("a") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                tail = log.read_text().strip().splitlines()[-3:]
                raise UserError(f"hdr serve exited with {proc.returncode}: {' | '.join(tail)}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise UserError(f"hdr serve did not answer /health within {timeout_s:.0f}s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------ training


def base_train_config(
    cfg: ExperimentConfig,
    url: str,
    sft_dir: Path,
    out_dir: Path,
    seed: int,
    extra: Sequence[str] = (),
):
    """The TrainConfig every arm starts from: the base YAML + the experiment's settings."""
    from hdr.config import load_config
    from trainer.config import TrainConfig

    overrides = [
        f"seed={seed}",
        f"steps={cfg.steps}",
        f"out_dir={out_dir}",
        f"model.path={sft_dir}",
        f"retrieval.urls=[{json.dumps(url)}]",
        f"retrieval.retriever={cfg.retriever}",
        f"grpo.batch_prompts={cfg.batch_prompts}",
        f"grpo.group_size={cfg.group_size}",
        f"grpo.lr={cfg.lr}",
        f"grpo.warmup_steps={min(3, cfg.steps - 1)}",
        f"replay.budget={cfg.replay_budget}",
        f"eval.every={cfg.eval_every}",
        f"eval.num_questions={cfg.eval_num_questions}",
        f"eval.k={cfg.eval_k}",
        "checkpoint.save_every=0",
        f"log.progress={str(cfg.progress).lower()}",
        *([f"replay.tau={cfg.tau}"] if cfg.tau is not None else []),
        *cfg.train_overrides,
        *extra,
    ]
    if not Path(cfg.base_config).is_file():
        raise UserError(f"base config not found: {cfg.base_config}")
    return load_config(TrainConfig, cfg.base_config, overrides)


def arm_train_config(
    cfg: ExperimentConfig, arm: Arm, url: str, sft_dir: Path, run_dir: Path, seed: int
):
    base = base_train_config(cfg, url, sft_dir, run_dir, seed)
    extra = [f"arm={arm.selector}", f"grpo.batch_prompts={round(arm.fresh * cfg.batch_prompts)}"]
    if not arm.replays:
        extra.append("replay.budget=0")
    if arm.selector == "headroom_drift_l1":
        extra.append(f"replay.tau={math.sqrt(base.replay.tau)}")
    return base_train_config(cfg, url, sft_dir, run_dir, seed, [*extra, *arm.overrides])


def ensure_sft(cfg: ExperimentConfig, url: str, log: Path) -> Path:
    """The shared SFT start under the data dir, trained once (`run_sft`) and then reused."""
    from trainer.sft import run_sft

    data = Path(cfg.data_dir)
    tag = "-".join(
        f"{k}{v}"
        for k, v in (("e", cfg.sft_epochs), ("n", cfg.sft_max_examples), ("c", cfg.corpus_limit))
        if v
    )
    sft_dir = data / (f"tiny-sft-{tag}" if tag else "tiny-sft")
    if (sft_dir / "config.json").is_file():
        return sft_dir
    extra = [
        f"sft.init_model={data / 'tiny-policy'}",
        f"sft.eval_questions={min(100, cfg.final_questions or 100)}",
    ]
    if cfg.sft_epochs:
        extra.append(f"sft.epochs={cfg.sft_epochs}")
    if cfg.sft_max_examples:
        extra.append(f"sft.max_examples={cfg.sft_max_examples}")
    config = base_train_config(cfg, url, sft_dir, Path(cfg.out_dir) / "sft", 0, extra)
    print(f"experiment: SFT start -> {sft_dir} (once; cached)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    run_sft(config)
    with log.open("a") as fh:
        fh.write(f"sft {sft_dir}: {time.perf_counter() - start:.0f}s\n")
    return sft_dir


def heldout_set(cfg: ExperimentConfig):
    """The final evaluation's questions: the same for every arm and seed."""
    from agent_env.data import load_task
    from evaluation.evaluate import EvalDataset
    from trainer.loop import heldout_subset

    examples = load_task("wiki-vital", "test")
    examples = heldout_subset(examples, 0, cfg.final_questions or len(examples))
    return [EvalDataset("wiki-vital", examples, ("wiki-vital",))]


def final_eval(cfg: ExperimentConfig, model_dir: Path, train_config, datasets, out: Path):
    """Held-out evaluation of one model (reused when `out/eval.json` exists)."""
    from evaluation.evaluate import EvalConfig, evaluate, load_report

    if (out / "eval.json").is_file():
        return load_report(out)
    eval_cfg = EvalConfig(
        k=cfg.final_k,
        greedy=True,
        seed=0,
        progress=cfg.progress,
        rollout=train_config.rollout,
        generation=train_config.generation,
        retrieval=train_config.retrieval,
    )
    return evaluate(model_dir, datasets, config=eval_cfg, out_dir=out)


@dataclass
class RunResult:
    arm: str
    seed: int
    run_dir: Path
    report: Any  # evaluation.evaluate.EvalReport
    metrics: list[dict[str, Any]]
    rollouts_per_step: int  # b x G of the arm: fresh episodes with the environment per step


def run_arm(cfg, arm: Arm, seed: int, url: str, sft_dir: Path, datasets) -> RunResult:
    from evaluation.plots import read_jsonl
    from trainer.loop import train

    run_dir = Path(cfg.out_dir) / "runs" / arm.name / f"seed-{seed}"
    config = arm_train_config(cfg, arm, url, sft_dir, run_dir, seed)
    done = (run_dir / "final" / "config.json").is_file()
    if not done:
        if run_dir.exists():  # an interrupted run: start it again from the SFT start
            import shutil

            shutil.rmtree(run_dir)
        print(f"experiment: training {arm.name} seed {seed}", file=sys.stderr, flush=True)
        train(config)
    report = final_eval(cfg, run_dir / "final", config, datasets, run_dir / "heldout")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    return RunResult(arm.name, seed, run_dir, report, metrics, config.grpo.fresh_rows)


def _job(cfg_json: str, arm: str, seed: int, url: str, sft_dir: str, threads: int) -> RunResult:
    """One arm x seed in a worker process (spawned: a clean torch with `threads` threads)."""
    import torch

    torch.set_num_threads(threads)
    cfg = ExperimentConfig.model_validate_json(cfg_json)
    start = time.perf_counter()
    result = run_arm(cfg, ARMS.get(arm), seed, url, Path(sft_dir), heldout_set(cfg))
    print(
        f"experiment: {arm} seed {seed} done in {time.perf_counter() - start:.0f}s",
        file=sys.stderr,
        flush=True,
    )
    return result


def run_all(cfg: ExperimentConfig, url: str, sft_dir: Path, datasets) -> list[RunResult]:
    """Every arm x seed, in table order; with `jobs` > 1, that many at once in worker
    processes (the two seeds of an arm run side by side, so each arm's wall times are
    measured under the same sharing of the CPU)."""
    tasks = [(name, seed) for name in cfg.arms for seed in cfg.seeds]
    if cfg.jobs == 1:
        return [run_arm(cfg, ARMS.get(n), s, url, sft_dir, datasets) for n, s in tasks]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    threads = max(1, (os.cpu_count() or 1) // cfg.jobs)
    quiet = cfg.model_copy(update={"progress": False}).model_dump_json()
    pool = ProcessPoolExecutor(
        cfg.jobs, mp_context=mp.get_context("spawn"), initializer=_die_with_parent
    )
    try:
        futures = [pool.submit(_job, quiet, n, s, url, str(sft_dir), threads) for n, s in tasks]
        results = [f.result() for f in futures]
    except BaseException:
        # a failed run or an interrupt: stop the other workers now instead of letting them
        # finish their runs (an unfinished run is started afresh on the next invocation)
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return results


# ------------------------------------------------------------------------------ summary

TIME_KEYS = ("time_generation", "time_retrieval", "time_scoring", "time_selection", "time_update")


def run_costs(metrics: list[dict[str, Any]], rollouts_per_step: int) -> dict[str, float]:
    """Totals of one run from its metrics.jsonl rows. `rollouts`: fresh episodes with the
    environment (steps x b x G); `search_calls`: search tool calls sent to the retrieval
    server; `env_calls`: the batched HTTP requests that carried them (one per search turn)."""
    if not metrics:
        raise UserError("a run has no metrics.jsonl rows")
    last = metrics[-1]

    def total(key: str) -> float:
        return float(sum(r.get(key) or 0.0 for r in metrics))

    out = {
        "steps": len(metrics),
        "rollouts": float(len(metrics) * rollouts_per_step),
        "env_calls": float(last.get("env_calls_total") or total("env_calls")),
        "search_calls": float(last.get("search_calls_total") or total("search_calls")),
        "wall_time": float(last.get("wall_time_total") or total("time_step")),
        "step_time_mean": total("time_step") / len(metrics),
        "fresh_tokens": total("fresh_tokens"),
        "replay_tokens": total("replay_tokens"),
        "replayed_groups": total("replayed_groups"),
    }
    for key in TIME_KEYS:
        out[key] = total(key)
    out["time_other"] = max(0.0, total("time_step") - sum(out[k] for k in TIME_KEYS))
    rates = [r["acceptance_rate"] for r in metrics if _finite(r.get("acceptance_rate"))]
    out["acceptance_rate_mean"] = float(np.mean(rates)) if rates else math.nan
    return out


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def summarize(results: list[RunResult], references: Sequence[str], sft_report=None) -> dict:
    """Per arm: held-out scores and costs over seeds, paired differences to the references."""
    arms: dict[str, list[RunResult]] = {}
    for r in results:
        arms.setdefault(r.arm, []).append(r)
    ids = None
    for r in results:
        q = r.report.question_ids()
        if ids is None:
            ids = q
        elif q != ids:
            raise UserError(f"{r.run_dir}: evaluated on other questions than the other runs")
    out: dict[str, Any] = {
        "arms": {},
        "num_questions": len(ids or []),
        "k": results[0].report.k if results else None,
    }

    def per_q(runs: list[RunResult], metric: str) -> np.ndarray:
        return np.stack([r.report.per_question(metric) for r in sorted(runs, key=lambda x: x.seed)])

    for name, runs in arms.items():
        runs.sort(key=lambda x: x.seed)
        costs = [run_costs(r.metrics, r.rollouts_per_step) for r in runs]
        entry: dict[str, Any] = {
            "seeds": [r.seed for r in runs],
            "run_dirs": [str(r.run_dir) for r in runs],
            "per_seed": {
                "mean_at_k": [r.report.average["mean_at_k"] for r in runs],
                "best_at_k": [r.report.average["best_at_k"] for r in runs],
                "greedy_em": [r.report.average["greedy_em"] for r in runs],
            },
            "costs_per_seed": costs,
            "diffs": {},
        }
        for metric in ("mean_at_k", "best_at_k", "greedy_em"):
            entry[metric] = mean_spread(entry["per_seed"][metric])
        entry["costs"] = {key: mean_spread([c[key] for c in costs]) for key in costs[0]}
        for ref in references:
            if ref == name or ref not in arms or name in references[: references.index(ref)]:
                continue  # itself, absent, or already shown as `name` vs `ref` the other way
            entry["diffs"][ref] = {
                metric: paired_difference(per_q(runs, short), per_q(arms[ref], short))
                for metric, short in (
                    ("mean_at_k", "mean"),
                    ("best_at_k", "best"),
                    ("greedy_em", "greedy"),
                )
            }
        out["arms"][name] = entry
    if sft_report is not None:
        out["sft_start"] = {
            "mean_at_k": sft_report.average["mean_at_k"],
            "best_at_k": sft_report.average["best_at_k"],
            "greedy_em": sft_report.average["greedy_em"],
        }
    return out


def _pm(spread, digits: int = 3) -> str:
    if spread.n == 1:
        return f"{spread.mean:.{digits}f}"
    return f"{spread.mean:.{digits}f} ± {spread.std:.{digits}f}"


def results_markdown(summary: dict, cfg: ExperimentConfig) -> str:
    """The three tables of docs/results.md: held-out quality, paired differences, cost."""
    k = summary["k"]
    lines = [
        f"Held-out: {summary['num_questions']} wiki-vital test questions, the same for every "
        f"run; k={k} samples at the rollout temperature plus greedy. Mean ± sample std over "
        f"seeds {cfg.seeds}.\n",
    ]
    rows = []
    if "sft_start" in summary:
        s = summary["sft_start"]
        rows.append(
            [
                f"({SFT_START})",
                "–",
                f"{s['mean_at_k']:.3f}",
                f"{s['best_at_k']:.3f}",
                f"{s['greedy_em']:.3f}",
            ]
        )
    for name, a in summary["arms"].items():
        rows.append(
            [name, len(a["seeds"]), _pm(a["mean_at_k"]), _pm(a["best_at_k"]), _pm(a["greedy_em"])]
        )
    lines.append(markdown_table(["arm", "seeds", f"Mean@{k}", f"Best@{k}", "greedy EM"], rows))
    diff_rows = []
    for name, a in summary["arms"].items():
        for ref, d in a["diffs"].items():
            cells = []
            noisy = False
            for metric in ("mean_at_k", "best_at_k", "greedy_em"):
                p = d[metric]
                seeds = ", ".join(f"{x:+.3f}" for x in p.per_seed)
                cells.append(f"{p.diff:+.3f} ± {p.se:.3f} [{seeds}]")
                noisy |= p.seed_std > abs(p.diff)
            diff_rows.append([name, ref, *cells, "yes" if noisy else "no"])
    if diff_rows:
        lines.append(
            "\nPaired differences (arm − reference) on the same questions: mean ± standard "
            "error over questions of the seed-averaged difference; in brackets the difference "
            "of each seed pair. Last column: whether the spread between seeds exceeds the "
            "difference for any metric (then the difference is not distinguishable from seed "
            "noise).\n"
        )
        lines.append(
            markdown_table(
                ["arm", "vs", f"Δ Mean@{k}", f"Δ Best@{k}", "Δ greedy EM", "seed spread > Δ"],
                diff_rows,
            )
        )
    cost_rows = []
    for name, a in summary["arms"].items():
        c = a["costs"]
        cost_rows.append(
            [
                name,
                f"{c['rollouts'].mean:.0f}",
                f"{c['search_calls'].mean:.0f}",
                f"{c['env_calls'].mean:.0f}",
                f"{c['wall_time'].mean / 60:.1f}",
                f"{c['step_time_mean'].mean:.2f}",
                *(f"{c[key].mean:.0f}" for key in (*TIME_KEYS, "time_other")),
                f"{c['replayed_groups'].mean:.0f}",
                "–"
                if math.isnan(c["acceptance_rate_mean"].mean)
                else f"{c['acceptance_rate_mean'].mean:.2f}",
            ]
        )
    lines.append(
        "\nCost per run (mean over seeds): rollouts are fresh episodes with the environment "
        "(steps x b x G); search calls are the tool calls they made; env requests are the "
        "batched HTTP requests that carried them (one per search turn); times in seconds, "
        "summed over steps (the periodic held-out evaluation is outside the split and the "
        "wall time).\n"
    )
    lines.append(
        markdown_table(
            [
                "arm",
                "rollouts",
                "search calls",
                "env requests",
                "wall (min)",
                "step (s)",
                "generation",
                "retrieval",
                "scoring",
                "selection",
                "update",
                "other",
                "replayed groups",
                "acceptance",
            ],
            cost_rows,
        )
    )
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
    }


# ---------------------------------------------------------------------------------- main


def run_experiment(cfg: ExperimentConfig) -> Path:
    """Everything above, in order; returns the out dir (results.json, results.md, charts/)."""
    from evaluation.plots import load_run, plot_runs

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "experiment.log"
    write_json_atomic(out / "experiment_config.json", cfg)
    started = time.perf_counter()
    index = ensure_index(cfg, log)
    datasets = heldout_set(cfg)
    results: list[RunResult] = []
    with _sigterm_as_exit(), serve(index, cfg.retriever, out / "server.log") as url:
        sft_dir = ensure_sft(cfg, url, log)
        sft_config = base_train_config(cfg, url, sft_dir, out / "sft", 0)
        sft_report = final_eval(cfg, sft_dir, sft_config, datasets, out / "sft_start")
        results = run_all(cfg, url, sft_dir, datasets)
    summary = summarize(results, cfg.references, sft_report)
    summary["config"] = cfg.model_dump()
    summary["machine"] = machine_info()
    summary["total_wall_time"] = time.perf_counter() - started
    summary["sft_dir"] = str(sft_dir)
    summary["server_url"] = url  # stopped by now
    charts = plot_runs([load_run(r.run_dir, label=r.arm) for r in results], out / "charts")
    summary["charts"] = [str(p.relative_to(out)) for p in charts]
    write_json_atomic(out / "results.json", summary)
    md = results_markdown(summary, cfg)
    md += "\nCharts: " + ", ".join(f"[{p.name}](charts/{p.name})" for p in charts) + "\n"
    write_text_atomic(out / "results.md", md)
    return out
