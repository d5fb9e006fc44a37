"""The training loop, `train(config)`: a run from its setup to its final model (`hdr train`).

The run is set up (or restored from a checkpoint) by `trainer/run.py`; its fresh groups come
from the trainer's own processes or, with `async_rollout.workers`, from rollout workers
(`trainer/async_rollout/workers.py`); each step is `trainer.step.train_step`, its record
`trainer.record.log_step`; around the steps, the periodic held-out evaluation
(`trainer/heldout.py`), the checkpoints and the stop signals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.errors import UserError
from core.progress import progress, say
from trainer import distributed
from trainer.async_rollout.workers import RolloutWorkerLost, RolloutWorkers
from trainer.checkpoint import list_checkpoints
from trainer.config import TrainConfig
from trainer.record import log_step
from trainer.run import Run, StopSignals, save, save_final, setup_run
from trainer.step import StepOutcome, train_step


def train(config: TrainConfig, resume: str | Path | None = None, force: bool = False) -> Path:
    """Run (or continue) training; returns the run directory. Under torchrun every process
    runs this; rank 0 alone logs and writes checkpoints. `force` starts a run with checkpoints
    or a final model in `out_dir` over (`trainer.run.prepare_run_dir`).

    SIGINT or SIGTERM (Ctrl-C, `kill`, a scheduler's preemption) stops the run after the
    current step, with a checkpoint of that step (step 0 when it comes before the first), and
    raises RunInterrupted saying how to continue; a second signal stops at once."""
    with StopSignals() as stop:
        run, start = setup_run(config, resume, force)
        try:
            if config.async_rollout.enabled:
                run.workers = RolloutWorkers.start(run, start)
            train_steps(run, start, stop)
        finally:
            run.fresh.close()  # rollouts in flight are discarded (re-rolled on resume)
            run.generator.close()
            distributed.shutdown(run.dist)
    return run.run_dir


def train_steps(run: Run, start: int, stop: StopSignals) -> None:
    """The steps from `start` with their evaluations and checkpoints, then `final/`."""
    config = run.config
    stop.check(run, start - 1)  # a signal while loading: stop before the first evaluation
    if start == 1 and config.eval.every and config.eval.at_start:
        log_heldout(run, 0)
        stop.check(run, 0)
    bar = progress(
        range(start, config.steps + 1),
        initial=start - 1,
        total=config.steps,
        desc=f"train {config.replay.rule}",
        unit="step",
        enabled=config.log.progress and run.dist.is_main,
    )
    for step in bar:
        record = log_step(run, step_or_stop(run, step))
        bar.set_postfix(reward=f"{record.reward_mean:.3f}", replay=record.replayed_groups)
        if config.eval.every and step % config.eval.every == 0:
            log_heldout(run, step)
        saved = None
        if config.checkpoint.save_every and step % config.checkpoint.save_every == 0:
            saved = save(run, step)
        stop.check(run, step, saved)
    bar.close()
    run.logs.groups_left(run.replay.groups(), None)
    save_final(run)
    run.logs.close()


def step_or_stop(run: Run, step: int) -> StepOutcome:
    """`train_step`; a retrieval outage longer than `retrieval.outage_grace_s` (the client has
    paused and polled that long) stops the run with one line naming its last checkpoint,
    which the stop leaves as it was."""
    from agent_env.retrieval_client import RetrievalUnavailable

    try:
        return train_step(run, step)
    except (RetrievalUnavailable, RolloutWorkerLost) as err:
        run.logs.flush()
        found = list_checkpoints(run.run_dir / "checkpoints")
        where = (
            f"last checkpoint: step {found[-1][0]}; continue with --resume {run.run_dir}"
            if found
            else "no checkpoint yet"
        )
        raise UserError(f"step {step} stopped: {err}; {where}") from None


def log_heldout(run: Run, step: int) -> dict[str, Any] | None:
    """The periodic held-out evaluation (every process evaluates its share of the questions):
    logged to eval.jsonl and printed as one line by rank 0."""
    from trainer.heldout import heldout_eval

    cfg, main = run.config.eval, run.dist.is_main
    if run.config.log.progress and main:
        say(f"held-out evaluation at step {step}: {len(run.eval_examples)} questions, k={cfg.k}")
    record = heldout_eval(run, step)
    if record is None or not main:
        return record
    run.logs.eval(record)
    k, greedy = record["k"], record["greedy_em"]
    say(
        f"step {step} held-out ({record['num_questions']} questions): Mean@{k}"
        f" {record['mean_at_k']:.3f}, Best@{k} {record['best_at_k']:.3f}"
        + (f", greedy EM {greedy:.3f}" if greedy is not None else "")
    )
    return record
