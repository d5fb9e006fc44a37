"""The experiment's arms: which replay rule a run uses and how much data a step takes.

An arm is a replay rule (`replay.rule`) at a batch: `on_policy` and `on_policy_larger` are one
rule at b and 1.5b fresh prompts. An arm is one registered `Arm`; presets name arms, and
`ARMS.get` refuses an unknown name with the valid ones listed. r = b/2 by default
(`ExperimentConfig.replay_ratio`), so the replay arms update on as many groups as
`on_policy_larger` while rolling out as few as `on_policy`.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.registry import Registry


@dataclass(frozen=True)
class Arm:
    """One comparison arm: a replay rule and how much fresh and replayed data a step uses.

    `fresh` is a multiple of the base b (`grpo.batch_prompts`); `replays` says whether the arm
    gets the replay budget r. `overrides` are extra dotted overrides.
    """

    name: str
    rule: str
    fresh: float = 1.0
    replays: bool = True
    overrides: tuple[str, ...] = ()
    doc: str = ""


ARMS: Registry[Arm] = Registry("experiment arm")


def register_arm(arm: Arm) -> None:
    ARMS.register(arm.name)(arm)


register_arm(Arm("on_policy", "on_policy", replays=False, doc="b fresh groups, no replay"))
register_arm(Arm("on_policy_larger", "on_policy", 1.5, replays=False, doc="1.5b fresh groups"))
register_arm(Arm("replay_recency", "replay_recency", doc="b fresh + the r newest stored groups"))
register_arm(Arm("headroom_drift", "headroom_drift", doc="b fresh + r by headroom, L2 drift gate"))
register_arm(Arm("headroom_only", "headroom_only", doc="b fresh + r by headroom, no gate"))
register_arm(Arm("drift_only", "drift_only", doc="b fresh + r newest passing the L2 drift gate"))
register_arm(Arm("headroom_drift_l1", "headroom_drift_l1", doc="b fresh + r by headroom, L1 gate"))
register_arm(
    Arm(
        "on_policy_filtered",
        "on_policy",
        replays=False,
        overrides=("grpo.dynamic_sampling=true",),
        doc="b fresh, zero-variance groups dropped and refilled by extra fresh prompts (DAPO)",
    )
)
register_arm(
    Arm(
        "replay_freshness_per",
        "replay_freshness_per",
        doc="b fresh + r sampled by |reward| x exp(-age/tau_age), importance-weighted",
    )
)
register_arm(
    Arm(
        "replay_zero_variance_swap",
        "replay_zero_variance_swap",
        doc="b fresh, zero-variance ones swapped for stored groups by sum|A| x std(r)",
    )
)
