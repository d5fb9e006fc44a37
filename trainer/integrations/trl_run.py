"""`hdr trl-train`: a TRL GRPO run with hdr's Search-R1 rollout and replay, from one YAML file.

`TRLRunConfig` holds hdr's side (model path, questions, retrieval, rollout, replay) as hdr's
own typed configs, and TRL's side as `trl:`, the keyword arguments of TRL's `GRPOConfig`
(checked by TRL's dataclass: an unknown or ill-typed key is one line). `configs/trl/` holds
instances: `tiny-cpu.yaml` (runs on a laptop CPU) and `qwen2.5-3b-8gpu.yaml` (written for one
node of eight GPUs, not run here). Under `accelerate launch` every process runs `train_trl`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field

from agent_env.data import DataConfig
from agent_env.retrieval_client import RetrievalConfig
from agent_env.rollout import RolloutConfig
from core.config import StrictModel
from core.errors import UserError
from trainer.integrations.trl import TRLReplayConfig

# hdr's defaults for TRL's GRPOConfig where TRL's own would surprise on hdr's task (TRL 1.16
# defaults: bf16 on, gradient checkpointing on, logging to every installed tracker)
TRL_DEFAULTS: dict[str, Any] = {"report_to": [], "logging_steps": 1, "save_strategy": "no"}


class TRLRunConfig(StrictModel):
    """A TRL GRPO run of a Search-R1 agent with hdr's rollout, reward and replay."""

    model: str = Field(..., description="Policy: a local directory or a hub id TRL loads.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training questions.")
    max_questions: int | None = Field(
        None, ge=1, description="Use only the first questions of the training split."
    )
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig, description="Server.")
    rollout: RolloutConfig = Field(
        default_factory=lambda: RolloutConfig(on_failure="keep"),
        description="The turn loop; temperature and top_p are TRL's (trl.temperature, top_p).",
    )
    hf_max_batch: int | None = Field(
        None, ge=1, description="transformers generation: most contexts per generate call."
    )
    replay: TRLReplayConfig = Field(default_factory=TRLReplayConfig, description="Replay.")
    trl: dict[str, Any] = Field(
        default_factory=dict, description="trl.GRPOConfig keyword arguments (output_dir, ...)."
    )


def grpo_args(config: TRLRunConfig):
    """TRL's `GRPOConfig` from the `trl:` section over hdr's defaults."""
    from trl import GRPOConfig

    try:
        return GRPOConfig(**{**TRL_DEFAULTS, **config.trl})
    except (TypeError, ValueError) as err:
        raise UserError(f"trl: {err}") from None


def build_trainer(config: TRLRunConfig, replay: bool = True):
    """A `ReplayGRPOTrainer` over `config` (TRL's own `GRPOTrainer` when not `replay`): the
    questions, a connected retrieval client, the rollout function and the rollout config's
    reward (exact match by default), as hdr's loop rewards."""
    from trl import GRPOTrainer

    from agent_env.data import load_task, question_pool
    from agent_env.retrieval_client import connect
    from trainer.integrations.accelerate_cpu import allow_deepspeed_on_cpu_processes
    from trainer.integrations.trl import ReplayGRPOTrainer
    from trainer.integrations.trl_rollout import (
        SearchR1Rollout,
        check_sampling_settings,
        search_r1_dataset,
        search_r1_reward,
    )
    from trainer.integrations.trl_vllm import route_colocate_sync

    allow_deepspeed_on_cpu_processes()  # before accelerate's state exists (grpo_args)
    args = grpo_args(config)
    try:  # before the questions, the retrieval server and the model are touched
        check_sampling_settings(args)
    except ValueError as err:
        raise UserError(str(err)) from None
    pool = question_pool(
        load_task(config.data.train, config.data.train_split), config.data.train_questions
    )
    examples = pool[: config.max_questions]  # the RL pool as hdr train draws it
    if not examples:
        raise UserError(f"training task {config.data.train!r} has no questions")
    client = connect(config.retrieval, seed=args.seed)
    pieces = dict(
        model=config.model,
        reward_funcs=[search_r1_reward(config.rollout)],
        args=args,
        train_dataset=search_r1_dataset(examples),
        rollout_func=SearchR1Rollout(client, config.rollout, config.hf_max_batch),
    )
    try:
        if not replay:
            trainer = GRPOTrainer(**pieces)
            route_colocate_sync(trainer)  # the CPU build refuses TRL's own colocated sync
            return trainer
        return ReplayGRPOTrainer(**pieces, replay=config.replay)
    except ValueError as err:  # TRL's and the replay's checks of the settings
        client.close()
        raise UserError(str(err)) from None


def train_trl(config: TRLRunConfig, resume: str | None = None) -> Path:
    """Train; returns TRL's output directory, where the final model is saved and each process
    writes what its replay did (`replay-{rank}.jsonl`). `resume`: a checkpoint directory, or
    "last" for the newest under `output_dir`; the replay buffer comes back with it."""
    trainer = build_trainer(config)
    checkpoint: str | bool | None = None
    if resume is not None:
        from transformers.trainer_utils import get_last_checkpoint

        checkpoint = get_last_checkpoint(trainer.args.output_dir) if resume == "last" else resume
        if not checkpoint or not Path(checkpoint).is_dir():
            trainer.rollout_func.client.close()
            raise UserError(f"--resume {resume}: no checkpoint in {trainer.args.output_dir}")
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
    finally:
        trainer.rollout_func.client.close()
    out = Path(trainer.args.output_dir)
    write_replay_log(
        trainer.replay.history, out / f"replay-{trainer.accelerator.process_index}.jsonl"
    )
    return out


def write_replay_log(history: list[dict], path: Path) -> None:
    """One JSON line per step (`StepReplay.record`): the fresh groups, what the selector
    scanned and admitted, the rows trained on."""
    path.write_text("".join(json.dumps(record) + "\n" for record in history))
