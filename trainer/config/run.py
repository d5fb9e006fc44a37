"""The run's housekeeping settings: the held-out evaluation (`eval`), checkpoints
(`checkpoint`), logs (`log`) and several processes (`distributed`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.config import StrictModel


class HeldoutConfig(StrictModel):
    """The periodic held-out evaluation during training."""

    every: int = Field(10, ge=0, description="Evaluate every this many steps (0: never).")
    num_questions: int = Field(64, ge=1, description="Size of the fixed held-out subset.")
    k: int = Field(5, ge=1, description="Samples per question for Mean@k / Best@k.")
    greedy: bool = Field(True, description="Also decode greedily for greedy EM.")
    at_start: bool = Field(True, description="Evaluate the starting policy as step 0.")


class CheckpointConfig(StrictModel):
    """Checkpoints for resuming."""

    save_every: int = Field(10, ge=0, description="Save every this many steps (0: never).")
    keep_last: int = Field(2, ge=1, description="Keep this many newest checkpoints.")


class WandbConfig(StrictModel):
    """Weights & Biases: every step's and held-out evaluation's record beside metrics.jsonl,
    under the names TensorBoard shows (`pip install -e ".[wandb]"`)."""

    mode: Literal["off", "online", "offline"] = Field(
        "off",
        description="off: no W&B; online: to the W&B server (WANDB_API_KEY); offline: a run"
        " folder under the run directory's wandb/, for `wandb sync` later.",
    )
    project: str = Field("hdr", min_length=1, description="The W&B project.")
    name: str | None = Field(None, description="The W&B run's name (default: the run dir's).")


class LogConfig(StrictModel):
    """Telemetry."""

    tensorboard: bool = Field(True, description="Also write TensorBoard events under tb/.")
    progress: bool = Field(True, description="Show a progress bar on stderr.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases.")


class DistributedConfig(StrictModel):
    """Data-parallel training under `torchrun` (trainer/distributed.py): every process holds the
    whole model (DistributedDataParallel); inert in one process. Sharded training (FSDP,
    ZeRO-3) is the TRL integration's (docs/integrations.md)."""

    rollout_shards: int = Field(
        1,
        ge=1,
        description="The step's prompts are rolled out in this many contiguous shards, each"
        " under its own seed (seed, step, shard); processes take whole shards, so a step's"
        " results do not depend on how many processes run it. Must be a multiple of the"
        " number of processes.",
    )
    timeout_s: float = Field(
        600.0,
        gt=0,
        description="A collective that waits longer than this fails the job (a dead or stuck"
        " process), instead of hanging; must exceed the held-out evaluation's duration.",
    )
