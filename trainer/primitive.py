"""Headroom-Drift Replay for any GRPO trainer, in one import: `GroupReplay`.

A facade over `trainer.replay` for code that is not hdr's loop (veRL, SkyRL, your own):
groups go in as plain tensors, a rule from `trainer.replay.RULES` picks stored groups each
step, and the caller's own teacher-forced scoring is the `score` callable. No hdr config,
model or HTTP is involved; like the rest of the primitive it imports torch and hdr's pure
tensor modules only. docs/integrations.md shows it in use; hdr's loop and its TRL
integration call the same rules (`trainer.selectors`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from trainer.grpo import group_advantages
from trainer.replay import RULES, ReplayBuffer, ScoreFn, Selection, StoredGroup, make_group


class GroupReplay:
    """A FIFO buffer of whole GRPO groups and a replay rule.

    `rule`: a name in `trainer.replay.RULES` (`headroom_drift`, `headroom_drift_l1`,
    `headroom_only`, `drift_only`, `replay_recency`, `on_policy`, `replay_freshness_per`,
    `replay_zero_variance_swap`); `params`: the fields of that rule's params dataclass, e.g.
    `budget` (R), `tau` (the drift gate), `norm`, `chunk` for the Headroom-Drift family.
    """

    def __init__(self, capacity: int, rule: str = "headroom_drift", **params) -> None:
        if rule not in RULES:
            raise ValueError(f"unknown replay rule {rule!r}; valid: {', '.join(RULES)}")
        self.rule = RULES[rule]
        self.params = self.rule.params_type(**params)
        self.buffer = ReplayBuffer(capacity)
        self.stored = 0  # groups offered to `store`, for default names

    def store(
        self,
        step: int,
        input_ids: Tensor,
        attention_mask: Tensor,
        loss_mask: Tensor,
        logprobs: Tensor,
        rewards: Tensor,
        advantages: Tensor | None = None,
        group_id: str | None = None,
    ) -> StoredGroup | None:
        """Keep one group made at `step` (call it after that step's update: ingress).

        `input_ids`, `attention_mask`, `loss_mask`, `logprobs`: `[G, T]`, left padded, each
        column aligned with `input_ids` (`loss_mask` 1 on the policy's tokens, `logprobs` the
        behaviour log-probs of those tokens, which a replay update divides by); `rewards`:
        `[G]`; `advantages`: `[G]`, by default `(r - mean) / (std + 1e-6)`. A group whose
        advantages are all 0 carries no gradient and is not kept (returns None)."""
        if advantages is None:
            advantages = group_advantages(rewards.unsqueeze(0))[0]
        self.stored += 1
        group = make_group(
            group_id or f"s{step}/{self.stored - 1}", input_ids, attention_mask, loss_mask,
            logprobs, rewards, advantages, step,
        )  # fmt: skip
        if group.all_zero_advantage:
            return None
        self.buffer.add(group)
        return group

    def select(self, step: int, score: ScoreFn, fresh: Sequence[StoredGroup] = ()) -> Selection:
        """The stored groups to replay at `step` (`Selection.groups`, with what the scan saw).

        `score(groups) -> [Tensor[G, T]]`: the current policy's log-probs of each group's
        tokens, teacher forced without gradient, aligned with its `input_ids`. Groups made at
        `step` or later are never picked. Each picked group counts one more replay."""
        selection = self.rule(self.buffer, step, self.params, score, fresh)
        for group in selection.groups:
            group.replay_count += 1
        return selection
