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
   test questions of the task (wiki-vital, or wiki-bridge with `--bridge`), identical for
   every arm and seed (and the SFT start once);
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

import hashlib
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
from typing import Any, Literal

import numpy as np
from pydantic import Field

from agent_env.policy import TinyPolicyConfig
from evaluation.metrics import (
    bootstrap_seeds_questions,
    markdown_table,
    mean_spread,
    paired_difference,
    paired_verdict,
    seed_t_interval,
)
from hdr.config import StrictModel
from hdr.errors import RunInterrupted, UserError
from hdr.paths import (
    EXPERIMENT,
    check_folder,
    check_output,
    write_json_atomic,
    write_text_atomic,
)
from hdr.progress import say
from hdr.registry import Registry
from trainer.telemetry import cost_totals

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
_add(
    Arm(
        "on_policy_filtered",
        "on_policy",
        replays=False,
        overrides=("grpo.dynamic_sampling=true",),
        doc="b fresh, zero-variance groups dropped and refilled by extra fresh prompts (DAPO)",
    )
)
_add(
    Arm(
        "replay_freshness_per",
        "replay_freshness_per",
        doc="b fresh + r sampled by |reward| x exp(-age/tau_age), importance-weighted",
    )
)
_add(
    Arm(
        "replay_zero_variance_swap",
        "replay_zero_variance_swap",
        doc="b fresh, zero-variance ones swapped for stored groups by sum|A| x std(r)",
    )
)

MAIN_ARMS = (
    "on_policy",
    "on_policy_larger",
    "on_policy_filtered",
    "replay_recency",
    "headroom_drift",
    "replay_freshness_per",
    "replay_zero_variance_swap",
)
MAIN_REFERENCES = ("on_policy_larger", "replay_recency")
ABLATION_ARMS = ("headroom_drift", "headroom_only", "drift_only", "headroom_drift_l1")
ABLATION_REFERENCES = ("headroom_drift",)
SFT_START = "sft_start"


class ExperimentConfig(StrictModel):
    """The experiment's knobs; `--quick` and `--ablations` are presets of these."""

    base_config: str = Field("configs/tiny-cpu.yaml", description="TrainConfig YAML of every arm.")
    task: str = Field(
        "wiki-vital", description="Training and held-out task: wiki-vital or wiki-bridge."
    )
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
    lr: float = Field(5e-5, gt=0, description="GRPO learning rate (docs/cpu-bed.md: 3e-5 to 1e-4).")
    tau: float | None = Field(None, gt=0, description="L2 drift gate; None: the base config's.")
    tau_l1: float | None = Field(
        None,
        gt=0,
        description="L1 gate of headroom_drift_l1, from its own `hdr calibrate` sweep; None:"
        " sqrt(tau), an upper bound by Jensen and so a looser gate than L2's.",
    )
    tau_age: float | None = Field(
        None,
        gt=0,
        description="replay_freshness_per's age scale in steps; None: steps / 4 (the published"
        " 500 steps is a quarter of a 2,000-step run).",
    )
    eval_every: int = Field(15, ge=0, description="Periodic held-out eval (eval.jsonl) interval.")
    eval_num_questions: int = Field(48, ge=1, description="Periodic held-out subset size.")
    eval_k: int = Field(4, ge=1, description="Samples per question in the periodic eval.")
    final_questions: int | None = Field(
        500,
        ge=1,
        description="Final held-out questions (a fixed set); None: the whole test split.",
    )
    final_k: int = Field(5, ge=1, description="Samples per question in the final evaluation.")
    policy: TinyPolicyConfig = Field(
        default_factory=TinyPolicyConfig,
        description="The tiny policy the SFT start is trained from (built once under the data"
        " dir; the demo's is smaller than the default).",
    )
    sft_epochs: int | None = Field(None, ge=1, description="SFT epochs; None: base config's.")
    sft_max_examples: int | None = Field(None, ge=1, description="SFT questions; None: all.")
    sft_overrides: list[str] = Field(
        [], description="Extra `sft.*` overrides of the SFT start (part of its cache name)."
    )
    sft_from_task: str | None = Field(
        None,
        description="Fine-tune the SFT start from this task's default SFT start (built first"
        " when missing) instead of from the bare policy: a curriculum. wiki-bridge has 972"
        " training questions, too few to learn copying from scratch; wiki-vital's start"
        " already copies a description into a search and a title into an answer.",
    )
    corpus_limit: int | None = Field(None, ge=1, description="Index only the first N articles.")
    retriever: str = Field("bm25", description="Retriever the server and rollouts use.")
    server_overrides: list[str] = Field(
        [],
        description="`hdr serve --set` settings, e.g. emulated_cost.request_latency_ms=500;"
        " the server's /health (emulated cost included) goes into results.json.",
    )
    schedule: Literal["interleaved", "by_arm"] = Field(
        "interleaved",
        description="interleaved: runs ordered seed by seed, every arm of a seed in turn, so"
        " with `jobs` runs at once every arm meets the same machine load; by_arm: arm by arm.",
    )
    bootstrap_resamples: int = Field(2000, ge=100, description="Seeds x questions bootstrap.")
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


# `hdr demo`: the whole pipeline once, on the embedded defaults: one headroom_drift run from
# an SFT start, evaluated beside that start. The trade for time: a smaller policy than the
# experiment's (hidden 64, MLP 256: 0.52M parameters against 1.57M, about 2.7x cheaper a
# token), with its own cached 8-epoch SFT start. SFT needs about as many trajectory visits
# whatever the size, learning rate or batch (the policy learns to copy suddenly, after 3-4
# epochs), and fewer epochs leave greedy EM near 0 and nothing for RL to learn from.
DEMO = {
    "arms": ["headroom_drift"],
    "references": [],
    "seeds": [1],
    "steps": 40,
    "final_questions": 300,
    "jobs": 1,
    "policy": {"hidden_size": 64, "intermediate_size": 256},
    "sft_epochs": 8,
    "sft_overrides": ["sft.lr=3e-3", "sft.length_batches=true"],
}


# The multi-turn, cost-dominated comparison (docs/results.md): bridge questions that need two
# searches, max_turns 2, the environment made to cost what a hosted search API does. The
# emulated cost (2 s a request + 40 ms a query) makes a step's environment wait (2 search
# turns of 40 queries: 7.2 s) about three times its rollout CPU time on this bed (2.2 s
# measured for on_policy at b=8, G=5), so a fresh group costs about 15x its teacher-forced
# re-scoring in the scan (0.085 CPU s): the regime of the paper's agentic-search claim.
# 5 seeds x 7 arms; a seed takes about 35 minutes on 2 cores, so a command runs one or two
# (`seeds=[n]`, `seeds=[n,m]`) within 120 minutes (see docs/results.md).
BRIDGE = {
    "task": "wiki-bridge",
    "seeds": [1, 2, 3, 4, 5],
    "steps": 40,
    "batch_prompts": 8,
    "group_size": 5,
    "eval_every": 10,
    "eval_num_questions": 48,
    "final_questions": None,
    # a run waits on the emulated API about half of its wall time or more (7.2 s of a 13 s
    # on_policy step), so two runs per core keep the 2 cores busy; token counts do not depend
    # on it, wall times and (less) CPU seconds do, alike for every arm as runs are interleaved
    "jobs": 4,
    "server_overrides": [
        "emulated_cost.request_latency_ms=2000",
        "emulated_cost.query_latency_ms=40",
    ],
    "train_overrides": [
        "rollout.max_turns=2",
        'rollout.prompt.observation_suffix=""',
    ],
    # 12 epochs from the bare policy left greedy EM at 0.00 (it never learned to copy the
    # description into the first search: 972 questions are too few); fine-tuned from the
    # wiki-vital start it reached 0.03, 0.12, 0.08, 0.10, 0.09, 0.10 over 6 epochs while its
    # train loss fell to 0.01 (memorising), so 3 epochs
    "sft_from_task": "wiki-vital",
    "sft_epochs": 3,
    # `hdr calibrate` at b=8, G=5 on this task from this start, 10 steps a point: the L2 gate
    # admitted 22% / 64% / 100% at tau 0.001 / 0.01 / 0.1; the L1 gate 41% / 87% / 100% at
    # 0.01 / 0.03 / 0.1 (its old default sqrt(0.01) = 0.1 did not gate at all)
    "tau": 0.01,
    "tau_l1": 0.01,
}


def experiment_config(
    quick: bool = False,
    ablations: bool = False,
    overrides: Sequence[str] = (),
    demo: bool = False,
    bridge: bool = False,
    **fields: Any,
) -> ExperimentConfig:
    """The preset (main, ablations or demo; full or quick), then explicit fields, then `k=v`
    overrides; unknown keys and unknown arms are UserErrors."""
    from hdr.config import build_config

    data: dict[str, Any] = {}
    if bridge:
        data.update(BRIDGE)
    if ablations:
        data.update(arms=list(ABLATION_ARMS), references=list(ABLATION_REFERENCES))
    if demo:
        data.update(DEMO)
    if quick:
        quick_preset = dict(QUICK)
        if bridge:  # the bridge task's articles span the whole corpus: keep its index whole
            quick_preset.pop("corpus_limit")
            quick_preset["sft_from_task"] = None  # a pipeline check: no 8-epoch wiki-vital start
            quick_preset["train_overrides"] = [
                *BRIDGE["train_overrides"],
                *QUICK["train_overrides"],
            ]
        data.update(quick_preset)
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
    """`<data>/index` over `<data>/wiki-vital.jsonl` (quick: a subset) when it is built (dense
    + BM25, what `make index` makes); otherwise, for runs that retrieve with bm25, BM25 alone
    in `<data>/index-bm25` (nothing to encode: seconds instead of minutes), else the full one."""
    data = Path(cfg.data_dir)
    suffix = f"-{cfg.corpus_limit}" if cfg.corpus_limit else ""
    corpus, index = data / f"wiki-vital{suffix}.jsonl", data / f"index{suffix}"
    if (index / "manifest.json").is_file():
        return index
    bm25_only = cfg.retriever == "bm25"
    if bm25_only:
        index = data / f"index{suffix}-bm25"
        if (index / "manifest.json").is_file():
            return index
    data.mkdir(parents=True, exist_ok=True)
    if not corpus.is_file():  # prepare-wiki writes it whole or not at all
        print(f"experiment: preparing the corpus {corpus}", file=sys.stderr, flush=True)
        limit = ["--limit", str(cfg.corpus_limit)] if cfg.corpus_limit else []
        _hdr("index", "prepare-wiki", "--out", str(corpus), *limit, log=log)
    print(f"experiment: building the index {index}", file=sys.stderr, flush=True)
    dense = ["--no-dense"] if bm25_only else []
    _hdr("index", "build", "--corpus", str(corpus), "--out", str(index), *dense, log=log)
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
def serve(
    index: Path,
    retriever: str,
    log: Path,
    timeout_s: float = 300.0,
    settings: Sequence[str] = (),
) -> Iterator[str]:
    """A real `hdr serve` subprocess on a free loopback port (`settings`: its `--set`
    options); yields its URL, stops it after."""
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
        *(arg for setting in settings for arg in ("--set", setting)),
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
        f"data.train={cfg.task}",
        f"data.eval={cfg.task}",
        f"replay.tau_age={cfg.tau_age or max(1.0, cfg.steps / 4)}",
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
        extra.append(f"replay.tau={cfg.tau_l1 or math.sqrt(base.replay.tau)}")
    return base_train_config(cfg, url, sft_dir, run_dir, seed, [*extra, *arm.overrides])


def short_hash(value: Any) -> str:
    """8 hex digits naming a setting in a cache path ("" for an empty one: the default)."""
    if not value:
        return ""
    return hashlib.sha1(json.dumps(value, sort_keys=True).encode()).hexdigest()[:8]


def policy_hash(cfg: ExperimentConfig) -> str:
    """The hash of the policy's non-default sizes ("" for the default policy)."""
    return short_hash(cfg.policy.model_dump(exclude_defaults=True))


def ensure_policy(cfg: ExperimentConfig) -> Path:
    """The tiny policy under the data dir (`tiny-policy`, or `tiny-policy-<hash>` for a
    non-default `policy`), built once."""
    from agent_env.policy import init_tiny_policy, vital_corpus_texts

    tag = policy_hash(cfg)
    path = Path(cfg.data_dir) / ("tiny-policy" + (f"-{tag}" if tag else ""))
    if not (path / "config.json").is_file():
        changed = cfg.policy.model_dump(exclude_defaults=True)
        say(f"experiment: building the tiny policy {path} {changed or ''}".rstrip())
        init_tiny_policy(path, vital_corpus_texts(), cfg.policy)
    return path


def sft_start_dir(cfg: ExperimentConfig) -> Path:
    """Where the SFT start lives under the data dir; its name tells what it was trained on and
    with (`tiny-sft` for the defaults), so starts of different tasks or settings never meet."""
    task = cfg.task if cfg.task != ExperimentConfig.model_fields["task"].default else ""
    tag = "-".join(
        f"{k}{v}"
        for k, v in (
            ("e", cfg.sft_epochs),
            ("n", cfg.sft_max_examples),
            ("c", cfg.corpus_limit),
            ("p", policy_hash(cfg)),
            ("s", short_hash(cfg.sft_overrides)),
        )
        if v
    )
    start = f"from-{cfg.sft_from_task}" if cfg.sft_from_task else ""
    name = "-".join(part for part in ("tiny-sft", task, tag, start) if part)
    return Path(cfg.data_dir) / name


def sft_prerequisite(cfg: ExperimentConfig) -> ExperimentConfig | None:
    """The experiment whose SFT start `cfg`'s start is fine-tuned from (`sft_from_task`): that
    task on the defaults (its own prompt and turns, not `cfg`'s overrides), same data, base
    config and policy."""
    if not cfg.sft_from_task:
        return None
    return ExperimentConfig(
        task=cfg.sft_from_task,
        data_dir=cfg.data_dir,
        out_dir=cfg.out_dir,
        base_config=cfg.base_config,
        policy=cfg.policy,
        retriever=cfg.retriever,
    )


def ensure_sft(cfg: ExperimentConfig, url: str, log: Path) -> Path:
    """The shared SFT start (`sft_start_dir`), trained once (`run_sft`) and then reused."""
    from trainer.sft import run_sft

    sft_dir = sft_start_dir(cfg)
    if (sft_dir / "config.json").is_file():
        return sft_dir
    prerequisite = sft_prerequisite(cfg)
    init = ensure_sft(prerequisite, url, log) if prerequisite else ensure_policy(cfg)
    extra = [
        f"sft.init_model={init}",
        f"sft.eval_questions={min(100, cfg.final_questions or 100)}",
    ]
    if cfg.sft_epochs:
        extra.append(f"sft.epochs={cfg.sft_epochs}")
    if cfg.sft_max_examples:
        extra.append(f"sft.max_examples={cfg.sft_max_examples}")
    extra += cfg.sft_overrides
    config = base_train_config(cfg, url, sft_dir, Path(cfg.out_dir) / "sft", 0, extra)
    say(f"experiment: SFT start -> {sft_dir} from {init} (once; cached)")
    start = time.perf_counter()
    run_sft(config)
    with log.open("a") as fh:
        fh.write(f"sft {sft_dir}: {time.perf_counter() - start:.0f}s\n")
    return sft_dir


def heldout_set(cfg: ExperimentConfig):
    """The final evaluation's questions: the same for every arm and seed."""
    from agent_env.data import load_task
    from evaluation.evaluate import EvalDataset
    from trainer.run import heldout_subset

    examples = load_task(cfg.task, "test")
    examples = heldout_subset(examples, 0, cfg.final_questions or len(examples))
    return [EvalDataset(cfg.task, examples, (cfg.task,))]


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
    report = evaluate(model_dir, datasets, config=eval_cfg, out_dir=out)
    a, k = report.average, report.k
    say(
        f"experiment: held-out {out.parent.name if out.name == 'heldout' else out.name}"
        f" ({sum(d.num_questions for d in report.datasets)} questions): Mean@{k}"
        f" {a['mean_at_k']:.3f}, Best@{k} {a['best_at_k']:.3f}, greedy EM {a['greedy_em']:.3f}"
    )
    return report


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
    from trainer.checkpoint import list_checkpoints
    from trainer.loop import train

    run_dir = Path(cfg.out_dir) / "runs" / arm.name / f"seed-{seed}"
    config = arm_train_config(cfg, arm, url, sft_dir, run_dir, seed)
    done = (run_dir / "final" / "config.json").is_file()
    if not done:
        print(f"experiment: training {arm.name} seed {seed}", file=sys.stderr, flush=True)
        if list_checkpoints(run_dir / "checkpoints"):  # stopped with a checkpoint: continue
            train(config, resume=run_dir)
        else:
            if run_dir.exists():  # stopped before any checkpoint: start it again
                import shutil

                shutil.rmtree(run_dir)
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


def run_order(cfg: ExperimentConfig) -> list[tuple[str, int]]:
    """(arm, seed) in the order runs start: seed by seed with every arm in turn
    (`interleaved`), or arm by arm."""
    if cfg.schedule == "interleaved":
        return [(name, seed) for seed in cfg.seeds for name in cfg.arms]
    return [(name, seed) for name in cfg.arms for seed in cfg.seeds]


def run_all(cfg: ExperimentConfig, url: str, sft_dir: Path, datasets) -> list[RunResult]:
    """Every arm x seed; with `jobs` > 1, that many at once in worker processes with
    cpu/jobs torch threads each. `interleaved` (default) orders them seed by seed with every
    arm in turn, so the arms share the machine alike; the ledger's CPU seconds and token
    counts do not depend on that sharing, wall times do."""
    tasks = run_order(cfg)
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
        # a failed run or an interrupt: kill the other workers now (an unfinished run is started
        # afresh on the next invocation). Not SIGTERM: a run would then finish its step, and
        # with the server about to stop that step waits minutes for retrieval to come back.
        workers = list(getattr(pool, "_processes", {}).values())
        for proc in workers:
            proc.kill()
        for proc in workers:
            proc.join(timeout=10)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return results


# ------------------------------------------------------------------------------ summary

TIME_KEYS = ("time_generation", "time_retrieval", "time_scoring", "time_selection", "time_update")
CPU_KEYS = ("cost_cpu_rollout_s", "cost_cpu_scoring_s", "cost_cpu_selection_s", "cost_cpu_update_s")
TF_KEYS = ("cost_behaviour_tf_tokens", "cost_scan_tf_tokens", "cost_update_tf_tokens")


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
    out.update(cost_totals(metrics))
    out["cost_cpu_s"] = sum(out[k] for k in CPU_KEYS)
    out["cost_tf_tokens"] = sum(out[k] for k in TF_KEYS)
    for key in TIME_KEYS:
        out[key] = total(key)
    out["time_other"] = max(0.0, total("time_step") - sum(out[k] for k in TIME_KEYS))
    rates = [r["acceptance_rate"] for r in metrics if _finite(r.get("acceptance_rate"))]
    out["acceptance_rate_mean"] = float(np.mean(rates)) if rates else math.nan
    return out


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


METRICS = (("mean_at_k", "mean"), ("best_at_k", "best"), ("greedy_em", "greedy"))


def seed_statistics(runs: list[RunResult], refs: list[RunResult], resamples: int) -> dict:
    """Per metric, over the seeds both arms ran: the t-interval over seeds of the per-seed
    paired difference and the seeds x questions bootstrap interval (95%)."""
    mine, theirs = {r.seed: r for r in runs}, {r.seed: r for r in refs}
    seeds = sorted(set(mine) & set(theirs))
    out = {}
    for metric, short in METRICS:
        a = np.stack([mine[s].report.per_question(short) for s in seeds])  # (S, Q)
        b = np.stack([theirs[s].report.per_question(short) for s in seeds])  # (S, Q)
        out[metric] = {
            "seeds": seeds,
            "t": seed_t_interval(list(a.mean(axis=1) - b.mean(axis=1))),
            "bootstrap": bootstrap_seeds_questions(a, b, resamples=resamples),
        }
    return out


def summarize(
    results: list[RunResult], references: Sequence[str], sft_report=None, resamples: int = 2000
) -> dict:
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
            "seed_stats": {},
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
            entry["seed_stats"][ref] = seed_statistics(runs, arms[ref], resamples)
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
        f"Held-out: {summary['num_questions']} {cfg.task} test questions, the same for every "
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
    lines += paired_tables(summary)
    lines += cost_tables(summary)
    return "\n".join(lines)


def _iv(interval) -> str:
    if math.isnan(interval.low):
        return f"{interval.mean:+.3f}"
    return f"{interval.mean:+.3f} [{interval.low:+.3f}, {interval.high:+.3f}]"


def paired_tables(summary: dict) -> list[str]:
    """Paired differences with seed-level intervals and their verdict (`paired_verdict`)."""
    k, rows = summary["k"], []
    for name, a in summary["arms"].items():
        for ref, stats in a["seed_stats"].items():
            cells, verdicts = [], []
            for metric, _ in METRICS:
                st = stats[metric]
                boot = st["bootstrap"]
                cells.append(f"{_iv(st['t'])}<br>boot [{boot.low:+.3f}, {boot.high:+.3f}]")
                verdicts.append(paired_verdict(st["t"], boot))
            rows.append([name, ref, len(stats["mean_at_k"]["seeds"]), *cells, " ".join(verdicts)])
    if not rows:
        return []
    return [
        "\nPaired differences (arm − reference), seeds matched (same seed: same SFT start and "
        "prompt order). First line: mean over seeds of the per-seed difference with its 95% "
        "t-interval over seeds; `boot`: 95% bootstrap interval resampling seeds and questions. "
        "Verdict per metric (Mean, Best, greedy): + or − when both intervals exclude 0 on the "
        "same side, 0 when either does not (no difference shown), n/a with one seed.\n",
        markdown_table(
            ["arm", "vs", "seeds", f"Δ Mean@{k}", f"Δ Best@{k}", "Δ greedy EM", "verdict"], rows
        ),
    ]


def cost_tables(summary: dict) -> list[str]:
    """The cost ledger per run (machine-independent counts; CPU seconds), then wall times."""
    ledger, walls = [], []
    for name, a in summary["arms"].items():
        c = {key: v.mean for key, v in a["costs"].items()}
        steps = max(c["steps"], 1)
        ledger.append(
            [
                name,
                f"{c['cost_fresh_groups']:.0f}",
                f"{c['cost_generated_tokens'] / 1e3:.1f}",
                f"{c['cost_behaviour_tf_tokens'] / 1e3:.1f}",
                f"{c['cost_scan_tf_tokens'] / 1e3:.1f}",
                f"{c['cost_update_tf_tokens'] / 1e3:.1f}",
                f"{c['cost_search_calls']:.0f}",
                f"{c['cost_env_requests']:.0f}",
                f"{c['cost_passages']:.0f}",
                f"{c['cost_informative_groups'] / steps:.1f}"
                f" / {c['cost_update_groups'] / steps:.1f}",
                f"{c['cost_replayed_groups']:.0f} / {c['cost_scanned_groups']:.0f}",
                f"{c['cost_cpu_s'] / 60:.1f}",
                f"{c['cost_env_wait_s'] / 60:.1f}",
            ]
        )
        walls.append(
            [
                name,
                f"{c['wall_time'] / 60:.1f}",
                f"{c['step_time_mean']:.2f}",
                *(f"{c[key]:.0f}" for key in (*TIME_KEYS, "time_other")),
                *(f"{c[key]:.0f}" for key in CPU_KEYS),
                "–"
                if math.isnan(c["acceptance_rate_mean"])
                else f"{c['acceptance_rate_mean']:.2f}",
            ]
        )
    return [
        "\nCost ledger per run (mean over seeds; `cost_*` of metrics.jsonl summed over steps). "
        "Counts are machine-independent: fresh groups rolled out (refills included), tokens in "
        "thousands (generated by the policy; teacher-forced in behaviour scoring, replay scan "
        "and update forward+backward), search tool calls, batched env requests, passages "
        "returned; informative / all groups per update; replayed / scanned groups. CPU is "
        "process CPU minutes over the four phases; env wait is wall minutes waiting on the "
        "environment (emulated cost included).\n",
        markdown_table(
            [
                "arm",
                "fresh groups",
                "gen tok (k)",
                "behav tf (k)",
                "scan tf (k)",
                "update tf (k)",
                "search calls",
                "env req",
                "passages",
                "informative/update",
                "replayed/scanned",
                "CPU (min)",
                "env wait (min)",
            ],
            ledger,
        ),
        "\nMachine-dependent times per run (mean over seeds, seconds unless stated): wall "
        "time, mean step, the wall split by phase, and process CPU seconds by phase.\n",
        markdown_table(
            [
                "arm",
                "wall (min)",
                "step (s)",
                "generation",
                "retrieval",
                "scoring",
                "selection",
                "update",
                "other",
                "CPU rollout",
                "CPU scoring",
                "CPU selection",
                "CPU update",
                "acceptance",
            ],
            walls,
        ),
    ]


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

    # an earlier run of the experiment is continued; anything else in the way is refused
    out = check_output(
        cfg.out_dir, EXPERIMENT, reuse=True, inputs=[cfg.data_dir, cfg.base_config], option="--out"
    )
    check_folder(cfg.data_dir, "--data-dir")  # hdr only adds its own, newly named files there
    out.mkdir(parents=True, exist_ok=True)
    log = out / "experiment.log"
    write_json_atomic(out / "experiment_config.json", cfg)
    started = time.perf_counter()
    index = ensure_index(cfg, log)
    datasets = heldout_set(cfg)
    results: list[RunResult] = []
    import httpx

    server_log = out / "server.log"
    try:
        with (
            _sigterm_as_exit(),
            serve(index, cfg.retriever, server_log, settings=cfg.server_overrides) as url,
        ):
            sft_dir = ensure_sft(cfg, url, log)
            sft_config = base_train_config(cfg, url, sft_dir, out / "sft", 0)
            sft_report = final_eval(cfg, sft_dir, sft_config, datasets, out / "sft_start")
            results = run_all(cfg, url, sft_dir, datasets)
            server_health = httpx.get(f"{url}/health", timeout=30).json()  # emulated cost totals
    except RunInterrupted as err:  # a run kept its checkpoint: the same command continues it
        message = str(err).split("; continue with")[0]
        raise RunInterrupted(f"{message}; rerun the same command to continue", err.signum) from None
    summary = summarize(results, cfg.references, sft_report, cfg.bootstrap_resamples)
    summary["server"] = server_health
    summary["config"] = cfg.model_dump()
    summary["machine"] = machine_info()
    summary["total_wall_time"] = time.perf_counter() - started
    summary["sft_dir"] = str(sft_dir)
    summary["server_url"] = url  # stopped by now
    runs = [load_run(r.run_dir, label=r.arm) for r in results]
    charts = plot_runs(runs, out / "charts", force=True)  # the experiment's own charts
    summary["charts"] = [str(p.relative_to(out)) for p in charts]
    write_json_atomic(out / "results.json", summary)
    md = results_markdown(summary, cfg)
    md += "\nCharts: " + ", ".join(f"[{p.name}](charts/{p.name})" for p in charts) + "\n"
    write_text_atomic(out / "results.md", md)
    return out
