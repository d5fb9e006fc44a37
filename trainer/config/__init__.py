"""The training run's typed configuration: one model per concern (one module per group of
sections beside this one), YAML files as instances.

`configs/tiny-cpu.yaml` and `configs/search-r1-qwen2.5-3b.yaml` are instances of
`TrainConfig`; `hdr train --config FILE a.b=value ...` loads one with dotted overrides
(`core.config.load_config`). Unknown keys are errors. Every default lives here and only here.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from agent_env.data import DataConfig
from agent_env.generation import GenerationConfig
from agent_env.retrieval_client import RetrievalConfig
from agent_env.rollout import RolloutConfig
from core.config import StrictModel, removed_in, renamed_in
from headroom_drift import GroupReplay
from trainer.config.async_rollout import AsyncConfig
from trainer.config.grpo import GRPOConfig
from trainer.config.history import REMOVED_KEYS, RENAMED_KEYS
from trainer.config.model import ModelConfig
from trainer.config.replay import GateConfig, ReplayConfig
from trainer.config.run import (
    CheckpointConfig,
    DistributedConfig,
    HeldoutConfig,
    LogConfig,
    WandbConfig,
)
from trainer.config.sft import SFTConfig

__all__ = [
    "AsyncConfig", "CheckpointConfig", "DistributedConfig", "GRPOConfig", "GateConfig",
    "HeldoutConfig", "LogConfig", "ModelConfig", "ReplayConfig", "SFTConfig", "TrainConfig",
    "WandbConfig",
]  # fmt: skip


class TrainConfig(StrictModel):
    """A GRPO training run with (or without) Headroom-Drift Replay."""

    seed: int = Field(0, description="Seeds python, numpy, torch and the prompt order.")
    steps: int = Field(100, ge=1, description="Training steps.")
    out_dir: str = Field("runs/train", description="The run directory.")
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    eval: HeldoutConfig = Field(default_factory=HeldoutConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    async_rollout: AsyncConfig = Field(default_factory=AsyncConfig)

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys_named(cls, data: Any) -> Any:
        """A key of `RENAMED_KEYS` is answered with the key it is now, one of `REMOVED_KEYS`
        with why it went (not silently dropped, not as an unknown key)."""
        renamed = renamed_in(data, RENAMED_KEYS) or removed_in(data, REMOVED_KEYS)
        if renamed is not None:
            raise ValueError(renamed)
        return data

    @model_validator(mode="after")
    def _steps_cover_warmup(self) -> TrainConfig:
        if self.grpo.warmup_steps >= self.steps and self.steps > 1:
            warmup = self.grpo.warmup_steps
            raise ValueError(
                f"steps={self.steps} leaves no step after grpo.warmup_steps={warmup} of warmup:"
                f" add grpo.warmup_steps={self.steps - 1} (or fewer), or more steps"
            )
        return self

    @model_validator(mode="after")
    def _sampling_the_trainer_can_score(self) -> TrainConfig:
        # teacher-forced log-probs divide by the temperature and nothing else: greedy or
        # nucleus samples would be scored under a distribution they were not drawn from
        if self.rollout.temperature <= 0:
            raise ValueError(
                "training samples, so rollout.temperature must be > 0 (0 is greedy): add"
                " rollout.temperature=1.0"
            )
        if self.rollout.top_p < 1:
            raise ValueError(
                "training scores the full distribution, so rollout.top_p must be 1 (the"
                " teacher-forced log-probs apply temperature only): add rollout.top_p=1"
            )
        return self

    @model_validator(mode="after")
    def _generation_seeded_by_the_run(self) -> TrainConfig:
        if self.generation.seed is None:
            self.generation.seed = self.seed
        return self

    @model_validator(mode="after")
    def _engine_holds_a_response(self) -> TrainConfig:
        limit, longest = self.generation.max_model_len, self.rollout.longest_response
        if self.generation.backend == "vllm" and limit is not None and limit <= longest:
            room = -(-(longest + 1024) // 1024) * 1024  # a 1,024-token prompt, rounded up
            raise ValueError(
                f"generation.max_model_len={limit} leaves no room for the prompt beside a"
                f" response of up to {longest} tokens (rollout.max_response_tokens +"
                f" max_tokens_per_turn + max_obs_tokens): add generation.max_model_len={room}"
            )
        return self

    @model_validator(mode="after")
    def _shards_hold_prompts(self) -> TrainConfig:
        if self.distributed.rollout_shards > self.grpo.batch_prompts:
            raise ValueError(
                f"distributed.rollout_shards={self.distributed.rollout_shards} exceeds"
                f" grpo.batch_prompts={self.grpo.batch_prompts} (a shard holds at least one"
                f" prompt): add distributed.rollout_shards={self.grpo.batch_prompts} or fewer"
            )
        return self

    @model_validator(mode="after")
    def _async_runs_what_it_supports(self) -> TrainConfig:
        a = self.async_rollout
        if a.max_lag > 0 and not a.enabled:
            raise ValueError(
                f"async_rollout.max_lag={a.max_lag} needs rollout workers:"
                " add async_rollout.workers=1"
            )
        if not a.enabled:
            return self
        refuse = [
            (
                self.generation.backend not in ("hf", "vllm"),
                "generation.backend=hf or vllm (the workers' generators)",
            ),
            (self.grpo.dynamic_sampling, "grpo.dynamic_sampling=false (no refills)"),
            (
                self.grpo.tis_cap is not None,
                "grpo.tis_cap=null (late groups train on the sampler's log-probs already)",
            ),
            (
                a.split == "shards" and self.distributed.rollout_shards % a.workers != 0,
                f"distributed.rollout_shards a multiple of async_rollout.workers={a.workers}",
            ),
            (
                bool(a.devices) and len(a.devices) != a.workers,
                f"one async_rollout.devices entry per worker ({a.workers}), not {len(a.devices)}",
            ),
        ]
        for broken, fix in refuse:
            if broken:
                raise ValueError(f"asynchronous rollout (async_rollout.workers > 0) needs {fix}")
        return self

    @model_validator(mode="after")
    def _skipped_rows_have_no_loss(self) -> TrainConfig:
        if not self.grpo.skip_zero_advantage:
            return self
        refuse = [
            (self.grpo.beta > 0, "grpo.beta=0 (the KL term of a skipped row is not 0)"),
            (
                self.replay.store_zero_advantage,
                "replay.store_zero_advantage=false (stored groups need their scores)",
            ),
            (self.async_rollout.enabled, "no rollout workers (late groups are gated by score)"),
        ]
        for broken, fix in refuse:
            if broken:
                raise ValueError(f"grpo.skip_zero_advantage needs {fix}")
        return self

    @property
    def replays(self) -> bool:
        """Whether the run replays at all (not `on_policy`, budget > 0, capacity > 0)."""
        return self.replay.replays

    def make_replay(self) -> GroupReplay:
        """The run's replay lifecycle: its rule with the `replay` knobs, the replay gate, and
        the staleness gate of late groups (`async_rollout`)."""
        late = self.async_rollout.late_groups(self.replay.drift_norm)
        return self.replay.make_replay(self.seed, self.steps, late)
