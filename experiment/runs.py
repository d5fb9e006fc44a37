"""Training and evaluating every arm x seed: the held-out set, one run, and the scheduler.

Every run starts from the same SFT start with the same seeds (so the same prompt order) and
is evaluated on one fixed held-out set. A finished run (its `final/` and `heldout/eval.json`)
is reused when the experiment is run again with the same out dir (or, without its model, a run
carried over by its exported evidence: `carried`), only when its
`config_hash.json` matches the config just built (a checkpointed or older run: the config.yaml
it wrote at its start), and its evaluation only when it used the same k, seed, temperature
and questions; otherwise one line names what differs.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.fingerprint import digest
from core.progress import say
from experiment.arms import Arm
from experiment.config import ExperimentConfig
from experiment.fingerprint import (
    HASH_FILE,
    check_reuse,
    run_ignored,
    run_settings,
    write_hash,
)
from experiment.server import die_with_parent
from experiment.train_configs import arm_train_config

if TYPE_CHECKING:
    from evaluation.evaluate import EvalDataset, EvalReport


def heldout_set(cfg: ExperimentConfig) -> list[EvalDataset]:
    """The final evaluation's questions: the same for every arm and seed."""
    from agent_env.data import heldout_subset, load_task
    from evaluation.evaluate import EvalDataset

    examples = load_task(cfg.task, "test")
    examples = heldout_subset(examples, 0, cfg.final_questions or len(examples))
    return [EvalDataset(cfg.task, examples, (cfg.task,))]


def eval_seed(cfg: ExperimentConfig, arm: str | None, seed: int) -> int:
    """The final evaluation's sampling seed: 0 (`final_eval_seed: fixed`), or one of each
    arm x seed's own (`per_run`, a stable hash), so no two runs share their draws."""
    if cfg.final_eval_seed == "fixed" or arm is None:
        return 0
    digest = hashlib.sha256(f"{arm}/{seed}".encode()).hexdigest()
    return int(digest[:8], 16)


def final_eval(
    cfg: ExperimentConfig,
    model_dir: Path,
    train_config,
    datasets: list[EvalDataset],
    out: Path,
    seed: int = 0,
) -> EvalReport:
    """Held-out evaluation of one model with sampling seed `seed` (reused when
    `out/eval.json` exists)."""
    from evaluation.evaluate import EvalConfig, evaluate, load_report, report_file

    eval_cfg = EvalConfig(
        k=cfg.final_k,
        greedy=True,
        seed=seed,
        progress=cfg.progress,
        rollout=train_config.rollout,
        generation=train_config.generation,
        retrieval=train_config.retrieval,
    )
    if report_file(out) is not None:  # reused only when it evaluated what is asked now
        report = load_report(out)
        wanted = eval_settings(eval_cfg.k, eval_cfg.seed, eval_cfg.sample_temperature, datasets)
        check_reuse(out, wanted, "held-out evaluation", report_settings(report))
        return report
    report = evaluate(model_dir, datasets, config=eval_cfg, out_dir=out)
    a, k = report.average, report.k
    run = out.parent if out.name == "heldout" else out  # runs/ARM/seed-N: both name it
    say(
        f"experiment: held-out {run.parent.name}/{run.name}"
        f" ({sum(d.num_questions for d in report.datasets)} questions): Mean@{k}"
        f" {a['mean_at_k']:.3f}, Best@{k} {a['best_at_k']:.3f}, greedy EM {a['greedy_em']:.3f}"
    )
    return report


def eval_settings(k: int, seed: int, temperature: float, datasets) -> dict[str, Any]:
    """What a held-out evaluation's scores depend on beside the model (whose own folder is
    checked): samples, sampling seed and temperature, and the questions (their digest)."""
    ids = [e.id for d in datasets for e in d.examples]
    return {"k": k, "seed": seed, "temperature": temperature, "questions": digest(ids)}


def report_settings(report: EvalReport) -> dict[str, Any]:
    """`eval_settings` as an evaluation's own eval.json records them."""
    return {"k": report.k, "seed": report.seed, "temperature": report.temperature,
            "questions": digest(report.question_ids())}  # fmt: skip


@dataclass
class RunResult:
    """One finished arm x seed: its held-out report and its metrics.jsonl rows."""

    arm: str
    seed: int
    run_dir: Path
    report: EvalReport
    metrics: list[dict[str, Any]]
    rollouts_per_step: int  # b x G of the arm: fresh episodes with the environment per step


def run_arm(
    cfg: ExperimentConfig, arm: Arm, seed: int, url: str, sft_dir: Path, datasets
) -> RunResult:
    """Train one arm x seed (continued from its checkpoint, or reused when finished) and
    evaluate its final model on the held-out set."""
    from evaluation.plots import read_jsonl
    from trainer.checkpoint import list_checkpoints
    from trainer.config.history import ADDED_KEYS, REMOVED_KEYS, RENAMED_KEYS
    from trainer.loop import train

    run_dir = Path(cfg.out_dir) / "runs" / arm.name / f"seed-{seed}"
    config = arm_train_config(cfg, arm, url, sft_dir, run_dir, seed)
    settings = run_settings(config, sft_dir, run_environment(cfg))
    done = (run_dir / "final" / "config.json").is_file() or carried(run_dir)

    def check_made_with_these_settings() -> None:
        written = settings_written(cfg, run_dir, sft_dir)
        check_reuse(
            run_dir,
            settings,
            "run",
            written,
            renamed=RENAMED_KEYS,
            added=ADDED_KEYS,
            removed=REMOVED_KEYS,
            ignored=run_ignored(settings),
        )

    if done:  # reused only when it was trained with exactly this config
        check_made_with_these_settings()
    else:
        print(f"experiment: training {arm.name} seed {seed}", file=sys.stderr, flush=True)
        if list_checkpoints(run_dir / "checkpoints"):  # stopped with a checkpoint: continue
            check_made_with_these_settings()
            train(config, resume=run_dir)
        else:
            if run_dir.exists():  # stopped before any checkpoint: start it again
                import shutil

                shutil.rmtree(run_dir)
            train(config)
        write_hash(run_dir, settings)
    report = final_eval(
        cfg,
        run_dir / "final",
        config,
        datasets,
        run_dir / "heldout",
        eval_seed(cfg, arm.name, seed),
    )
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    return RunResult(arm.name, seed, run_dir, report, metrics, config.grpo.fresh_rows)


def carried(run_dir: Path) -> bool:
    """A run carried over from another machine or session by its exported evidence (`hdr
    report --export`, copied into the out dir): no model, but its config hash, metrics and
    held-out evaluation, which is all the experiment reads of a finished run. It counts as
    finished only when that hash matches the config built now (checked by the caller)."""
    from evaluation.evaluate import report_file

    evidence = [run_dir / HASH_FILE, run_dir / "metrics.jsonl"]
    return all(p.is_file() for p in evidence) and report_file(run_dir / "heldout") is not None


def run_environment(cfg: ExperimentConfig) -> dict[str, Any]:
    """What the retrieval server of the runs was started with (part of a run's hash)."""
    return {"corpus_limit": cfg.corpus_limit, "server_overrides": list(cfg.server_overrides)}


def settings_written(cfg: ExperimentConfig, run_dir: Path, sft_dir: Path) -> dict[str, Any] | None:
    """A run's settings read back from the config.yaml training wrote at its start (None
    without one): what an unfinished run, or one finished before runs carried a hash, is
    checked against. Its SFT start's hash is the current one (the run never recorded it)."""
    from trainer.run import read_run_config

    if not (run_dir / "config.yaml").is_file():
        return None
    config = read_run_config(run_dir / "config.yaml")
    return run_settings(config, sft_dir, run_environment(cfg))


def run_arm_in_worker(
    cfg_json: str, arm: str, seed: int, url: str, sft_dir: str, threads: int
) -> RunResult:
    """`run_arm` in a worker process (spawned: a clean torch with `threads` threads)."""
    import torch

    torch.set_num_threads(threads)
    cfg = ExperimentConfig.model_validate_json(cfg_json)
    start = time.perf_counter()
    result = run_arm(cfg, cfg.arm(arm), seed, url, Path(sft_dir), heldout_set(cfg))
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
        return [run_arm(cfg, cfg.arm(n), s, url, sft_dir, datasets) for n, s in tasks]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    threads = max(1, (os.cpu_count() or 1) // cfg.jobs)
    quiet = cfg.model_copy(update={"progress": False}).model_dump_json()
    pool = ProcessPoolExecutor(
        cfg.jobs, mp_context=mp.get_context("spawn"), initializer=die_with_parent
    )
    try:
        futures = [
            pool.submit(run_arm_in_worker, quiet, n, s, url, str(sft_dir), threads)
            for n, s in tasks
        ]
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
