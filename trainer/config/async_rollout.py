"""Asynchronous rollout's settings (`async_rollout`): rollout workers and late groups."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from core.config import StrictModel
from headroom_drift import STALENESS_RULES, LateGroups, staleness_rule
from trainer.config.replay import GateConfig


class AsyncConfig(StrictModel):
    """Asynchronous rollout (trainer/async_rollout/workers.py): rollout worker processes generate
    ahead of the trainer, and a staleness rule decides which late groups enter the update.
    The defaults (no workers, `max_lag` 0) are the synchronous loop."""

    workers: int = Field(
        0,
        ge=0,
        description="Rollout worker processes (each with its own copy of the weights, its own"
        " generator: hf, or a vLLM engine with generation.backend=vllm, and its own retrieval"
        " client), sharing the rollouts as `split` says."
        " 0: rollouts run in the trainer's process.",
    )
    split: Literal["steps", "shards"] = Field(
        "steps",
        description="How the workers share the rollouts: steps dealt round-robin (with"
        " max_lag >= 1 several steps roll out at once), or every step's"
        " `distributed.rollout_shards` split among them (a step's rollout in parallel; with"
        " max_lag 0, the synchronous loop issuing `workers` concurrent requests).",
    )
    max_lag: int = Field(
        0,
        ge=0,
        description="Queue bound and hard version cap k: step s's rollout may start once the"
        " weights of update s-1-k are published, so a group is at most k updates late"
        " (AReaL's max_head_offpolicyness). 0: every rollout waits for the last update, the"
        " synchronous loop.",
    )
    rule: str = Field(
        "version_bound",
        description="Staleness rule for late groups: " + ", ".join(sorted(STALENESS_RULES)),
    )
    tau: float = Field(
        0.05,
        gt=0,
        description="drift_gate: admit a late group when D(g) <= tau; adaptive_drift_gate: the"
        " starting tau. Same drift as the replay gate (`replay.drift_norm`).",
    )
    adaptive_gate: GateConfig = Field(
        default_factory=GateConfig,
        description="adaptive_drift_gate: the target the staleness tau holds over the late"
        " groups (shares its names with replay.adaptive_gate).",
    )
    start_timeout_s: float = Field(
        600.0, gt=0, description="Most seconds a worker may take to load and report ready."
    )
    worker_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per worker; None: the trainer's (what makes `max_lag` 0"
        " bit-identical to the synchronous loop). With more threads than cores over all"
        " processes, OpenMP's waiting threads slow every process down: give workers 1 each"
        " on a small machine.",
    )
    devices: list[str] = Field(
        default_factory=list,
        description="The device map: one device per worker (`cuda:N` among the GPUs this"
        " process sees, or `cpu`), where its generator runs (its vLLM engine, or its hf copy"
        " of the policy). Empty: every worker on `model.device`. `hdr plan-memory` counts each"
        " worker on its device, the trainer's included, and the run refuses a map that does"
        " not fit (docs/trainer.md, Asynchronous rollout).",
    )

    @field_validator("devices")
    @classmethod
    def _devices_are_cuda_or_cpu(cls, v: list[str]) -> list[str]:
        for device in v:
            if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
                raise ValueError(f"async_rollout.devices: {device!r} is not cpu, cuda or cuda:N")
        return v

    @field_validator("rule")
    @classmethod
    def _known_rule(cls, v: str) -> str:
        staleness_rule(v)  # a ValueError listing the valid names on a miss
        return v

    @property
    def enabled(self) -> bool:
        """Whether rollouts run in worker processes."""
        return self.workers > 0

    def late_groups(self, norm: str) -> LateGroups:
        """The staleness rule and its drift gate (`GateConfig.build`, starting at `tau`;
        adaptive for a rule that adapts it), under the replay gate's drift `norm`. A late
        group the rule rejects enters the replay buffer, where the replay gate decides."""
        adaptive = staleness_rule(self.rule).adaptive
        gate = self.adaptive_gate.build(self.tau, adaptive=adaptive)
        return LateGroups(self.rule, gate, self.max_lag, norm, keep_rejected=True)
