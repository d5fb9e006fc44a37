"""The replay settings (`replay`): the buffer, the budget, the drift gate, the scan."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from core.config import StrictModel
from headroom_drift import (
    RULES,
    AdaptiveGate,
    FixedGate,
    Gate,
    GroupReplay,
    LateGroups,
    is_gated,
    replay_rule,
    rule_params,
)


class GateConfig(StrictModel):
    """An adaptive drift gate (`headroom_drift.AdaptiveGate`): the target it holds, and how fast
    its tau moves. One set of names for both of its uses: the replay scan's gate
    (`replay.adaptive_gate`, with `replay.gate: adaptive`) and the staleness gate of late
    groups (`async_rollout.adaptive_gate`, with `async_rollout.rule: adaptive_drift_gate`);
    each starts at its own section's `tau`. `build` is the one factory of both gates."""

    target_kind: Literal["acceptance", "drift_budget"] = Field(
        "acceptance",
        description="Hold the share of the groups scored that are admitted (acceptance), or"
        " the mean drift of the groups admitted (drift_budget).",
    )
    target: float = Field(
        0.5, gt=0, description="The acceptance rate (<= 1) or the drift budget to hold."
    )
    rate: float = Field(0.1, gt=0, description="Log-space step of tau per decision.")

    @model_validator(mode="after")
    def _acceptance_is_a_share(self) -> GateConfig:
        if self.target_kind == "acceptance" and self.target > 1:
            raise ValueError(f"target={self.target} is an acceptance rate: add one <= 1")
        return self

    def build(self, tau: float, adaptive: bool) -> Gate:
        """The gate a section names: an AdaptiveGate that starts at `tau` and holds this
        target, or (not `adaptive`) the paper's constant `FixedGate(tau)`."""
        if not adaptive:
            return FixedGate(tau)
        return AdaptiveGate(tau=tau, target=self.target, kind=self.target_kind, rate=self.rate)


class ReplayConfig(StrictModel):
    """The replay rule, its buffer and its knobs."""

    rule: str = Field("headroom_drift", description="The replay rule: " + ", ".join(sorted(RULES)))
    budget: int = Field(8, ge=0, description="R: most stored groups replayed per step.")
    capacity: int = Field(64, ge=0, description="C: FIFO buffer capacity in groups.")
    tau: float = Field(
        0.05, ge=0, description="Drift gate: admit when D(g) <= tau (gate adaptive: the start)."
    )
    gate: Literal["fixed", "adaptive"] = Field(
        "fixed",
        description="The replay scan's drift gate: fixed (the paper's constant tau) or"
        " adaptive (tau moves each step to hold `adaptive_gate`'s target; logged per step as"
        " replay_tau).",
    )
    adaptive_gate: GateConfig = Field(
        default_factory=GateConfig,
        description="gate adaptive: the target the scan's tau holds (shares its names with"
        " async_rollout.adaptive_gate).",
    )
    drift_norm: Literal["l2", "l1"] = Field(
        "l2", description="Drift of the gate for headroom_drift and drift_only (l2: mean sq.)."
    )
    scan_chunk: int = Field(8, ge=1, description="Most groups scored per scan chunk.")
    tau_age: float = Field(
        500.0,
        gt=0,
        description="replay_freshness_per: age scale (steps) of the priority's decay"
        " exp(-age / tau_age); the published default is 500 steps.",
    )
    is_beta_start: float = Field(
        0.4, ge=0, le=1, description="replay_freshness_per: importance exponent at step 0 (-> 1)."
    )
    store_zero_advantage: bool = Field(
        False, description="Store groups whose advantages are all 0 (they carry no gradient)."
    )
    survey: Literal["off", "newest", "buffer"] = Field(
        "off",
        description="A diagnostic, off the cost ledger and timed apart (time_survey): each"
        " step, before the selection and at its weights, score stored groups without admitting"
        " them and log their age, drift and headroom (survey_*): `newest`, the `budget` newest"
        " (what replay_recency would replay from the same buffer: the counterfactual);"
        " `buffer`, every eligible group (the admissible pool at any tau: calibration).",
    )
    reuse_scan_forward: bool = Field(
        False,
        description="Score replay candidates with grad and keep the admitted groups' graphs,"
        " so the update's first pass backpropagates through the scan's forward instead of"
        " repeating it (one process only; memory: the graphs of up to R groups at once).",
    )

    @field_validator("rule")
    @classmethod
    def _known_rule(cls, v: str) -> str:
        try:
            replay_rule(v)
        except ValueError as miss:  # its line lists the valid names
            raise ValueError(
                f"{miss} (an arm of `hdr experiment` such as on_policy_larger is a rule at a"
                " batch: docs/guide.md's table of arms says which)"
            ) from None
        return v

    @model_validator(mode="after")
    def _adaptive_gate_has_a_tau(self) -> ReplayConfig:
        if self.gate == "adaptive" and not is_gated(self.rule):
            raise ValueError(
                f"replay.gate=adaptive adapts a drift gate, and replay.rule={self.rule} has none:"
                " add replay.gate=fixed, or a rule that gates by drift (headroom_drift)"
            )
        return self

    @model_validator(mode="after")
    def _adaptive_tau_in_range(self) -> ReplayConfig:
        if self.gate == "adaptive" and not 1e-8 <= self.tau <= 1e4:
            raise ValueError(
                f"replay.gate=adaptive starts from replay.tau={self.tau}, outside the gate's"
                " range [1e-8, 1e4]: add a replay.tau inside it"
            )
        return self

    def make_gate(self) -> Gate:
        """The replay scan's drift gate (`GateConfig.build`), starting at `tau`."""
        return self.adaptive_gate.build(self.tau, adaptive=self.gate == "adaptive")

    @property
    def replays(self) -> bool:
        """Whether the rule replays at all under these settings (not `on_policy`, budget > 0,
        capacity > 0)."""
        return self.rule != "on_policy" and self.budget > 0 and self.capacity > 0

    def make_replay(
        self, seed: int, total_steps: int, late: LateGroups | None = None
    ) -> GroupReplay:
        """The replay lifecycle these settings describe (budget 0 where the rule does not
        `replay`) in a run of `total_steps` seeded by `seed`; `late`: its staleness gate."""
        params = rule_params(
            self.rule,
            budget=self.budget if self.replays else 0,
            tau=self.tau,
            norm=self.drift_norm,
            chunk=self.scan_chunk,
            seed=seed,
            total_steps=total_steps,
            tau_age=self.tau_age,
            is_beta_start=self.is_beta_start,
        )
        return GroupReplay.from_params(
            self.capacity, self.rule, params, gate=self.make_gate(),
            store_zero_advantage=self.store_zero_advantage, late=late,
        )  # fmt: skip
