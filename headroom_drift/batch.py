"""One update's batch: the step's fresh groups and the replayed ones as one set of rows.

Fresh and replayed rows take the same loss (docs/design.md); what differs is carried by the
rows: a replayed row's old log-probs are its stored generation-time ones (the ratio's
denominator), its advantages are scaled by its rule's importance weight (1 but for
`replay_freshness_per`), and its tokens keep the per-token weights its fresh step used (TRL's
importance-sampling ratio), where a fresh row's may carry truncated importance weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from headroom_drift.groups import GroupTensors, StoredGroup, concat_left_padded
from headroom_drift.objective import weighted_advantages


@dataclass(kw_only=True)
class Rows(GroupTensors):
    """A batch's rows (`Batch.rows`): every group's tensors, `[N, T]` left padded to one width
    and `[N]`. `gen_logprobs` are the ratio's old log-probs (the behaviour ones of a fresh
    row, the stored ones of a replayed row); `advantages` as the update weighs them (a
    replayed group's scaled by its selection weight); `token_weights` 1 off the policy tokens.
    The first `num_fresh_rows` rows are fresh."""

    num_fresh_rows: int


@dataclass
class Batch:
    """One update's groups: fresh ones first, then replayed ones, each with its (weighted)
    advantages and, with TIS, its token weights. A pure value: `rows()` makes the tensors."""

    groups: list[StoredGroup]
    advantages: list[Tensor]  # per group [G]; a replayed group's scaled by its selection weight
    token_weights: list[Tensor] | None  # per group [G, T_g]: TIS on fresh tokens, 1 on replayed
    positions: list[int]  # each group's place in the whole update
    first_replayed: int  # the position where the replayed groups begin
    scale: float = 1.0  # 0: a process dealt no group runs one with zero weight

    @property
    def policy_tokens(self) -> Tensor:
        """The token mean's denominator: the policy tokens of every group (at least 1)."""
        return torch.stack([g.loss_mask.sum() for g in self.groups]).sum().clamp(min=1.0)

    def shard(self, rank: int, world: int) -> Batch:
        """This process's round-robin share of the groups. A process dealt none takes the
        first group with `scale` 0, so it still joins the gradient all-reduce."""
        dealt = list(range(rank, len(self.groups), world))
        take = dealt or [0]
        return Batch(
            groups=[self.groups[j] for j in take],
            advantages=[self.advantages[j] for j in take],
            token_weights=None if self.token_weights is None else [
                self.token_weights[j] for j in take
            ],
            positions=[self.positions[j] for j in take],
            first_replayed=self.first_replayed,
            scale=1.0 if dealt else 0.0,
        )  # fmt: skip

    def rows(self) -> Rows:
        """The groups' rows stacked to one width (`GroupTensors.stack`), with the advantages
        and token weights the update applies."""
        stacked = GroupTensors.stack(self.groups)
        weights = None
        if self.token_weights is not None:
            weights = concat_left_padded(self.token_weights)  # (N, T)
            weights = torch.where(stacked.loss_mask.bool(), weights, torch.ones_like(weights))
        fresh = [g for g, at in zip(self.groups, self.positions, strict=True)
                 if at < self.first_replayed]  # fmt: skip
        return Rows(
            input_ids=stacked.input_ids,
            attention_mask=stacked.attention_mask,
            loss_mask=stacked.loss_mask,
            gen_logprobs=stacked.gen_logprobs,
            rewards=stacked.rewards,
            advantages=torch.cat(self.advantages),  # (N,)
            token_weights=weights,
            num_fresh_rows=sum(len(g.input_ids) for g in fresh),
        )


def assemble_batch(
    fresh: list[StoredGroup],
    replayed: list[StoredGroup],
    weights: Sequence[float] = (),
    tis: list[Tensor] | None = None,
) -> Batch:
    """The update's batch from the fresh and replayed groups. `weights` (one per replayed
    group, a sampling rule's importance weights; empty: 1) scale the replayed groups'
    advantages (`weighted_advantages`); `tis` (one `[G, T_g]` per fresh group) weights the
    fresh tokens; a replayed group's tokens carry the weights stored with it
    (`StoredGroup.token_weights`, the fresh step's), 1 when it has none."""
    weights = list(weights) or [1.0] * len(replayed)
    token_weights = None
    if tis is not None or any(g.token_weights is not None for g in replayed):
        fresh_weights = tis if tis is not None else [torch.ones_like(g.gen_logprobs) for g in fresh]
        token_weights = [*fresh_weights, *(stored_weights(g) for g in replayed)]
    return Batch(
        groups=[*fresh, *replayed],
        advantages=[g.advantages for g in fresh]
        + [weighted_advantages(g.advantages, w) for g, w in zip(replayed, weights, strict=True)],
        token_weights=token_weights,
        positions=list(range(len(fresh) + len(replayed))),
        first_replayed=len(fresh),
    )


def stored_weights(group: StoredGroup) -> Tensor:
    """A stored group's per-token weights `[G, T]`: those its fresh step used, else 1."""
    if group.token_weights is None:
        return torch.ones_like(group.gen_logprobs)
    return group.token_weights
