"""The GRPO update's settings (`grpo`): batch, group size, learning rate, loss."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.config import StrictModel


class GRPOConfig(StrictModel):
    """Fresh batch, objective and optimizer."""

    batch_prompts: int = Field(16, ge=1, description="b: fresh prompts per step.")
    group_size: int = Field(8, ge=2, description="G: sampled responses per prompt.")
    lr: float = Field(
        5e-5, ge=0, description="AdamW peak learning rate (0: a control run that never moves)."
    )
    warmup_steps: int = Field(3, ge=0, description="Linear warmup steps from 0 to `lr`.")
    schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After warmup: constant, or cosine decay to 0 at the last step."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the gradient's global L2 norm to this.")
    eps_low: float = Field(0.2, ge=0, lt=1, description="Ratio clip below: 1 - eps_low.")
    eps_high: float = Field(0.2, ge=0, description="Ratio clip above: 1 + eps_high.")
    beta: float = Field(0.0, ge=0, description="k3 KL coefficient to the initial policy (0: off).")
    updates_per_step: int = Field(1, ge=1, description="Optimizer passes over each step's batch.")
    micro_batch: int = Field(32, ge=1, description="Rows per forward/backward chunk (memory).")
    score_chunk: int = Field(64, ge=1, description="Rows per no-grad scoring chunk (memory).")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO-style: drop groups whose rewards are all equal and refill the batch"
        " with extra fresh prompts (counted as fresh cost), up to `refill_rounds` times.",
    )
    refill_rounds: int = Field(3, ge=0, description="Most refill rollouts per step.")
    skip_zero_advantage: bool = Field(
        False,
        description="Forward no fresh row whose advantage is 0: a group whose G rewards are"
        " equal is not scored, and such rows stay out of the update's forwards. Their loss"
        " is 0, so the update is the same (up to float rounding); their tokens still count"
        " in the token mean. Needs grpo.beta=0, replay.store_zero_advantage=false and one"
        " process.",
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="Truncated importance sampling of fresh tokens: weight each by"
        " min(p_trainer/p_sampler, tis_cap) against the sampler/trainer mismatch (vLLM);"
        " None: off.",
    )

    @property
    def fresh_rows(self) -> int:
        """Responses rolled out per step: b * G."""
        return self.batch_prompts * self.group_size
