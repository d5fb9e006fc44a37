"""A training run's state and what happens around its steps: setup, the run directory,
checkpoints and stop signals. The steps themselves are `trainer/step.py`, the loop over them
`trainer/loop.py`.

`setup_run(config)` checks before it writes: the model path (one line, no hub asked, when a
local path is missing), the run directory (`check_run_dir`), the training data and the
retrieval server; then it loads the model and builds the optimizer, the replay lifecycle
(`headroom_drift.GroupReplay`: buffer and gates), the generator and the logs into a `Run`. A
resumed run restores all of it from a checkpoint (`trainer/checkpoint.py`), so its steps
continue bit for bit on the CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from core.config import build_config, dump_config, load_config, read_config_file
from core.errors import RunInterrupted, UserError
from core.paths import RUN, check_output, local_model
from core.progress import say
from headroom_drift import GroupReplay, Selection, StoredGroup
from trainer import distributed
from trainer.checkpoint import (
    Checkpoint,
    TrainState,
    list_checkpoints,
    open_checkpoint,
    restore_buffer,
    save_checkpoint,
    save_model,
)
from trainer.config import TrainConfig
from trainer.config.history import read_as_today
from trainer.fresh import FreshSource, InProcessRollout, LazyGenerator, RolloutContext
from trainer.scoring import compute_context, score_groups
from trainer.telemetry import RunLogs, require_wandb

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from agent_env.data import QAExample
    from agent_env.generation.base import Generator
    from agent_env.retrieval_client import RetrievalClient


@dataclass
class RunCounters:
    """Totals over the run so far (saved in every checkpoint)."""

    env_calls_total: int = 0
    search_calls_total: int = 0
    billed_search_calls_total: int = 0  # 0 in a checkpoint from before the split: a resumed
    cached_search_calls_total: int = 0  # run's totals then count from the resume on
    wall_time_total: float = 0.0


@dataclass
class Run:
    """What persists between steps: the model and its optimizer, the replay lifecycle, the
    generator, the retrieval client, the data, the logs, the run's totals. Built by
    `setup_run`; a step (`trainer.step.train_step`) trains the model and the replay, and its
    record (`trainer.record`) moves the totals on."""

    config: TrainConfig
    run_dir: Path
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    replay: GroupReplay  # the buffer, the rule, the replay and staleness gates, their state
    generator: Generator
    client: RetrievalClient
    train_examples: list[QAExample]
    eval_examples: list[QAExample]
    logs: RunLogs | distributed.SilentLogs
    ref_model: PreTrainedModel | None = None
    dist: distributed.Dist = field(default_factory=distributed.Dist)
    policy: torch.nn.Module | None = None  # the update's forward module (DDP across processes)
    counters: RunCounters = field(default_factory=RunCounters)
    workers: FreshSource | None = None  # rollout workers (trainer/async_rollout/workers.py), if any

    @property
    def rollout_context(self) -> RolloutContext:
        """What this run's rollouts read (`trainer.fresh`), as the run holds it now."""
        return RolloutContext(self.config, self.generator, self.client, self.tokenizer, self.dist)

    @property
    def fresh(self) -> FreshSource:
        """Where the steps' fresh groups come from: the rollout workers, else this run's own
        processes (with the generator and client it holds at the time)."""
        if self.workers is not None:
            return self.workers
        return InProcessRollout(self.rollout_context, self.train_examples)

    def score(self, groups: list[StoredGroup], with_grad: bool | None = None) -> list[torch.Tensor]:
        """The replay `ScoreFn`: current-policy log-probs of stored groups; across processes
        each rank scores its round-robin share and every rank gets all of them. With
        `replay.reuse_scan_forward` (one process) the log-probs keep their graphs, unless
        `with_grad=False` (the survey, which nothing trains through)."""
        with_grad = self.reuses_scan_forward if with_grad is None else with_grad
        with self.autocast():
            return self.dist.split_map(
                groups,
                lambda part: score_groups(
                    self.model,
                    part,
                    self.config.grpo.score_chunk,
                    self.config.rollout.temperature,
                    with_grad=with_grad,
                ),
            )

    @property
    def reuses_scan_forward(self) -> bool:
        return self.config.replay.reuse_scan_forward and self.dist.world == 1

    def scan_graphs(self, selection: Selection) -> list[torch.Tensor] | None:
        """The admitted groups' scan log-probs with their graphs, for the update to
        backpropagate through, when this run reuses the scan's forward and the selector
        scored every group it admitted (the sampling and recency selectors score none)."""
        admitted = selection.groups
        if self.reuses_scan_forward and admitted and len(selection.scored) == len(admitted):
            return selection.scored
        return None

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 compute on the float32 master weights when `model.compute_dtype` asks."""
        return compute_context(self.model, self.config.model.compute_dtype)


# --- setup -----------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_lambda(config: TrainConfig):
    """Linear warmup over `warmup_steps`, then constant or cosine to 0 at the last step."""
    warmup, total, cosine = config.grpo.warmup_steps, config.steps, config.grpo.schedule == "cosine"

    def factor(done: int) -> float:  # `done` optimizer steps taken so far
        if done < warmup:
            return (done + 1) / (warmup + 1)
        if not cosine:
            return 1.0
        progress = (done - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + np.cos(np.pi * min(progress, 1.0)))

    return factor


def load_policy(model_dir: str | Path, config: TrainConfig, frozen: bool = False):
    """Model and tokenizer from a directory. Trained weights load in `model.dtype` (fp32
    master weights); a `frozen` one (the KL reference) in `model.compute_dtype`."""
    from transformers import AutoModelForCausalLM

    from agent_env.runner import load_tokenizer

    path = str(model_dir)
    dtype = getattr(torch, config.model.compute_dtype if frozen else config.model.dtype)
    try:  # a local directory, or a Hub id (Qwen/Qwen2.5-3B-Instruct) when online or cached
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"cannot load model {path}: {first}") from None
    model = model.to(config.model.device).eval()
    if config.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if config.model.train_layers is not None and not frozen:
        from trainer.frozen_bottom import attach

        dtype = getattr(torch, config.model.bottom_cache_dtype)
        try:
            attach(model, config.model.train_layers, dtype, config.model.bottom_cache_mib << 20)
        except ValueError as err:
            raise UserError(f"model.{err}") from None
    return model, load_tokenizer(path)


def build_optimizer(model, config: TrainConfig):
    """AdamW over the master weights (fused on CUDA: one kernel, no per-tensor temporaries)
    and the warmup schedule."""
    g = config.grpo
    fused = next(model.parameters()).is_cuda
    trained = [p for p in model.parameters() if p.requires_grad]  # all, unless model.train_layers
    optimizer = torch.optim.AdamW(
        trained, lr=g.lr, betas=g.betas, weight_decay=g.weight_decay, fused=fused
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    return optimizer, scheduler


RUN_FILES = ("config.yaml", "metrics.jsonl", "eval.jsonl", "groups.jsonl")
RUN_DIRS = ("tb", "wandb", "checkpoints", "final")
"""What `hdr train` writes into a run directory (what starting over removes, and only that)."""


def clear_run(run_dir: Path) -> None:
    """Remove a run's own files and folders from `run_dir`; anything else stays."""
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for name in RUN_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)


def check_run_dir(config: TrainConfig, force: bool = False) -> Path:
    """`out_dir` may take a new run (writes nothing): it is new, empty or an earlier run, and
    never the model it trains. An earlier run with checkpoints or a final model is started over
    only with `force`; one that never reached a checkpoint (stopped by a missing server, a
    crash) is simply started over. One UserError line otherwise."""
    run_dir = check_output(
        config.out_dir, RUN, reuse=True, inputs=[config.model.path], option="out_dir"
    )
    found = list_checkpoints(run_dir / "checkpoints")
    if found and not force:
        raise UserError(
            f"run directory {run_dir} already holds a run (checkpoint at step {found[-1][0]});"
            f" continue it with `hdr train --resume {run_dir}`, start it over with --force, or"
            " choose another out_dir"
        )
    if (run_dir / "final").exists() and not force:
        raise UserError(
            f"run directory {run_dir} holds a finished run; start it over with --force or"
            " choose another out_dir"
        )
    return run_dir


def prepare_run_dir(config: TrainConfig, ckpt: Checkpoint | None, force: bool = False) -> Path:
    """The run directory: the checkpoint's on resume; else `out_dir` as `check_run_dir` allows
    it, an earlier run's own files removed (and nothing else)."""
    if ckpt is not None:
        run_dir = ckpt.run_dir
        # a step-0 checkpoint (stopped before the first step) evaluates step 0 again
        RunLogs.truncate_after(run_dir, ckpt.step if ckpt.step > 0 else -1)
        return run_dir
    run_dir = check_run_dir(config, force)
    if RUN.recognise(run_dir):
        if not list_checkpoints(run_dir / "checkpoints") and not (run_dir / "final").exists():
            say(f"hdr train: {run_dir} holds a run that never reached a checkpoint; starting over")
        clear_run(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def cache_scope(config: TrainConfig) -> str:
    """The run's own cache on the retrieval server (X-HDR-Cache-Scope): a digest of its
    directory (ASCII whatever the path), the same for every process, rollout worker and resume
    of the run. Its searches are answered from its own earlier ones (billed once) and never
    from another run's, so the arms of one experiment sharing a server each pay for their own.
    Its bill still depends on the server: answers share the server's one byte bound (another
    run's traffic can evict them), and a run started again in the same directory finds the
    answers its first start left."""
    digest = hashlib.sha256(str(Path(config.out_dir).resolve()).encode()).hexdigest()
    return f"train:{digest[:32]}"


def setup_run(
    config: TrainConfig, resume: str | Path | None = None, force: bool = False
) -> tuple[Run, int]:
    """Build the run (fresh or from a checkpoint); returns it and the first step to run.
    Nothing is written, and no model loaded, before the model path, the output folder, the
    data and the server are checked."""
    from agent_env.data import load_questions
    from agent_env.generation import build_generator
    from agent_env.retrieval_client import connect

    dist, config = distributed.init_distributed(config)
    if config.grpo.skip_zero_advantage and dist.world > 1:
        raise UserError(
            "grpo.skip_zero_advantage runs in one process (a process whose rows were all"
            " skipped would miss the gradients' all-reduce): drop it under torchrun"
        )
    seed_everything(config.seed)
    require_wandb(config.log.wandb)  # one line before anything is written
    ckpt = open_checkpoint(resume) if resume is not None else None
    if ckpt is None:  # the model, then the run dir: one line, before any hub is asked
        local_model(
            config.model.path,
            f"`hdr sft --config FILE` writes it ({config.sft.epochs}"
            " epochs of supervised warm start from sft.init_model)",
        )
        dist.on_main(lambda: check_run_dir(config, force))
    train_examples, eval_examples = load_questions(
        config.data, config.seed, config.eval.num_questions
    )
    # no server: one line, at once
    client = connect(config.retrieval, seed=config.seed, cache_scope=cache_scope(config))

    def make_run_dir() -> Path:
        run_dir = prepare_run_dir(config, ckpt, force)
        (run_dir / "config.yaml").write_text(dump_config(config))
        return run_dir

    run_dir = dist.on_main(make_run_dir)  # rank 0 alone writes the run directory
    model_dir = ckpt.model_dir if ckpt else config.model.path
    model, tokenizer = load_policy(model_dir, config)
    optimizer, scheduler = build_optimizer(model, config)
    ref_model = None
    if config.grpo.beta > 0:
        ref_model, _ = load_policy(config.model.path, config, frozen=True)
        ref_model.requires_grad_(False)

    def make_generator():
        return build_generator(
            config.generation,
            model_dir=model_dir,
            tokenizer=tokenizer,
            prompt=config.rollout.prompt,
            model=model if config.generation.backend == "hf" else None,
        )

    if config.async_rollout.enabled and config.generation.backend != "hf":
        # the rollout workers hold the engines; this one only for a held-out evaluation
        generator = LazyGenerator(make_generator, model, per_request_seeds=True)
    else:
        generator = make_generator()
    # the weights it already has, through the sync every update uses: a name mismatch (an
    # engine parameter the state dict does not reach) fails here, not after a step's work
    generator.sync_weights(model)
    run = Run(
        config=config,
        run_dir=run_dir,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        replay=config.make_replay(),
        generator=generator,
        client=client,
        train_examples=train_examples,
        eval_examples=eval_examples,
        logs=RunLogs(
            run_dir,
            config.log.tensorboard,
            purge_step=ckpt.step + 1 if ckpt else None,
            wandb=config.log.wandb,
            config=config.model_dump(mode="json"),
        )
        if dist.is_main
        else distributed.SilentLogs(),
        ref_model=ref_model,
        dist=dist,
        policy=distributed.wrap_policy(model, dist),
    )
    start = 1
    if ckpt is not None:
        run.optimizer.load_state_dict(ckpt.optimizer_state())
        scheduler.load_state_dict(ckpt.scheduler_state())
        start = ckpt.step + 1
        restore_buffer(ckpt, run.replay, run.logs, run.model, run.autocast, start)
        run.counters = RunCounters(**{k: v for k, v in ckpt.counters().items() if k != "step"})
        ckpt.restore_rng(dist.rank, dist.world)
    return run, start


def load_train_config(path: str | None, overrides: list[str], resume: str | None) -> TrainConfig:
    """The config of `hdr train`: the file with overrides, or on resume the checkpoint's
    config with the overrides applied on top."""
    if resume is None:
        if path is None:
            raise UserError("hdr train needs --config FILE (or --resume DIR)")
        return load_config(TrainConfig, path, overrides)
    if path is not None:
        raise UserError("--resume continues a run with its own config; drop --config")
    return read_run_config(open_checkpoint(resume).path / "config.yaml", overrides)


def read_run_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """The config a run wrote (its `config.yaml`, a checkpoint's), with `overrides`. A run of
    an earlier hdr wrote keys renamed or removed since (`trainer.config.history`): it is read
    under today's keys."""
    return build_config(TrainConfig, read_as_today(read_config_file(path)), overrides)


# --- checkpoints and the final model ------------------------------------------------------


def save(run: Run, step: int) -> Path | None:
    """Every process hands rank 0 its RNG state; rank 0 writes the checkpoint."""
    rng_states = distributed.gather_rng_states(run.dist)
    if not run.dist.is_main:
        return None
    state = TrainState(
        model=run.model,
        tokenizer=run.tokenizer,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        replay=run.replay,
        counters=asdict(run.counters),
        config_yaml=dump_config(run.config),
        model_files=model_files(run.config),
        rng_states=rng_states,
    )
    run.logs.flush()
    return save_checkpoint(
        run.run_dir / "checkpoints", step, state, run.config.checkpoint.keep_last
    )


def model_files(config: TrainConfig) -> dict[str, str]:
    """Saved beside every model of the run: the prompt and rollout settings it is trained with."""
    from agent_env.policy_settings import SETTINGS_FILE, settings_yaml

    return {SETTINGS_FILE: settings_yaml(config.rollout, config.retrieval)}


def save_final(run: Run) -> Path | None:
    """`final/`: model and tokenizer, loadable with from_pretrained, and the rollout settings
    (written atomically, by rank 0)."""
    if not run.dist.is_main:
        return None
    return save_model(run.model, run.tokenizer, run.run_dir / "final", model_files(run.config))


# --- stopping ------------------------------------------------------------------------------


STOPPING = b"hdr train: stopping after this step with a checkpoint (again to stop at once)\n"


class StopSignals:
    """SIGINT/SIGTERM as a request to stop at the next step boundary (see `train`). Across
    processes the request is agreed at every boundary, so all ranks checkpoint the same step
    and stop together, whichever rank (or ranks) the signal reached; no rank leaves before
    rank 0 has written the checkpoint (`distributed.shutdown`'s barrier), because torchrun
    stops the others 30 s after the first rank exits. Outside the main thread (no signal
    handlers there) it does nothing.

    torchrun itself, on SIGTERM, passes it to every rank and SIGKILLs them after
    `--shutdown-timeout` seconds (30 unless that or TORCH_ELASTIC_SHUTDOWN_TIMEOUT says
    otherwise): launch with more than a step, a held-out evaluation and a checkpoint take."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        # Nothing here may import: the signal can land inside an import (a run's first seconds
        # import transformers), and Python 3.11's import lock then breaks with a KeyError when
        # the handler imports too (tqdm.write does, building its lock on first use).
        if self.signum is not None:  # the second one: stop now, without a checkpoint
            raise KeyboardInterrupt
        self.signum = signum
        os.write(2, STOPPING)

    def __enter__(self) -> StopSignals:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                number = getattr(signal, name)
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        import signal

        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def check(self, run: Run, step: int, saved: Path | None = None) -> None:
        """After `step`: when a stop was requested on any process, checkpoint the step and
        raise (on every process)."""
        import signal

        signum = self.signum or 0
        if run.dist.world > 1:  # the largest signal number any rank received (0: none)
            signum = max(run.dist.all_gather(signum))
        if not signum:
            return
        path = saved or save(run, step)
        run.logs.close()
        name = signal.Signals(signum).name
        raise RunInterrupted(
            f"stopped by {name} after step {step} of {run.config.steps}; checkpoint {path};"
            f" continue with: hdr train --resume {run.run_dir}",
            signum,
        )
