"""Headroom-Drift Replay: a replay control primitive for GRPO, in plain PyTorch.

The method of "Headroom-Drift Replay: A Primitive for Principled Replay Control in GRPO"
(arXiv 2609.03941): a buffer of whole GRPO groups, re-scored teacher-forced instead of rolled
out again; Headroom ranks them by the learning value the current policy leaves, Policy Drift
gates them by how far it has moved from the policy that sampled them. This package imports
torch and numpy only (no model, config or HTTP), so any GRPO trainer can call it:

- `objective`: group advantages, the clipped token-mean policy loss, k3 KL, truncated IS;
- `scores`: `headroom`, `policy_drift`;
- `groups`: the group value (`GroupTensors`, `StoredGroup`) and the FIFO `ReplayBuffer`;
- `gates`: `FixedGate` (the paper's tau) and `AdaptiveGate` (tau held to a target online);
- `selection`, `published`, `rules`: the scan, the paper's comparison rules and two published
  replay rules, every one by name in `RULES` (`replay_rule(name)`);
- `staleness`: the same gate for late groups of rollouts that run ahead of the trainer;
- `batch`: fresh and replayed groups as one update's rows;
- `lifecycle`: `GroupReplay`, the one owner of the buffer, the gates and their state.
"""

from headroom_drift.batch import Batch, Rows, assemble_batch
from headroom_drift.gates import AdaptiveGate, FixedGate, Gate, adapt_tau
from headroom_drift.groups import GroupTensors, ReplayBuffer, StoredGroup, make_group
from headroom_drift.lifecycle import GroupReplay, LateGroups
from headroom_drift.objective import group_advantages, kl_k3, masked_mean, policy_loss
from headroom_drift.rules import (
    ORDERED_RULES,
    RULES,
    is_gated,
    register_rule,
    replay_rule,
    rule_params,
)
from headroom_drift.scores import headroom, policy_drift
from headroom_drift.selection import Candidate, ReplayRule, ScanParams, ScoreFn, Selection
from headroom_drift.staleness import STALENESS_RULES, LateDecision, staleness_rule

__all__ = [
    "ORDERED_RULES",
    "RULES",
    "STALENESS_RULES",
    "AdaptiveGate",
    "Batch",
    "Candidate",
    "FixedGate",
    "Gate",
    "GroupReplay",
    "GroupTensors",
    "LateDecision",
    "LateGroups",
    "ReplayBuffer",
    "ReplayRule",
    "Rows",
    "ScanParams",
    "ScoreFn",
    "Selection",
    "StoredGroup",
    "adapt_tau",
    "assemble_batch",
    "group_advantages",
    "headroom",
    "is_gated",
    "kl_k3",
    "make_group",
    "masked_mean",
    "policy_drift",
    "policy_loss",
    "register_rule",
    "replay_rule",
    "rule_params",
    "staleness_rule",
]
