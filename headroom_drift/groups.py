"""The unit of replay, a whole GRPO group, and the FIFO buffer that holds them.

A group is one prompt's `G` responses as left-padded token ids with the loss mask `m`, the
generation-time (behaviour) log-probs, rewards and advantages, all aligned with `input_ids`
(`loss_mask[i, t]` and `gen_logprobs[i, t]` refer to token `input_ids[i, t]`; column 0 is
never a policy token). `GroupTensors` is that value; `StoredGroup` adds its place in the
buffer's lifecycle (its stored headroom, the step it entered, how often it was replayed).
The buffer is a FIFO of capacity `C`: the oldest group leaves first, whatever its priority.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from headroom_drift.scores import headroom


def concat_left_padded(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate `[n_k, T_k]` left-padded blocks into `[sum n_k, max T_k]` (zeros on the
    left: left padding only prepends columns)."""
    width = max(t.shape[1] for t in tensors)
    return torch.cat([F.pad(t, (width - t.shape[1], 0)) for t in tensors], dim=0)


@dataclass
class GroupTensors:
    """A GRPO group's tensors, each aligned with its `input_ids`: `[G, T]`, left padded, or
    `[G]`. What a group is to the formulas; it travels as one value from a trainer's scoring
    to `make_group`, `GroupReplay.store` and an update's rows. Several groups' rows stacked to
    one width are one value too (`stack`; `take` cuts one group back out)."""

    input_ids: Tensor  # (G, T) int64, left padded
    attention_mask: Tensor  # (G, T) int64
    loss_mask: Tensor  # (G, T) float32, 1 on policy tokens
    gen_logprobs: Tensor  # (G, T) float32, 0 off the mask: the behaviour log-probs
    rewards: Tensor  # (G,) float32
    advantages: Tensor  # (G,) float32
    # (G, T) float32 per-token weights from the step that made the group (e.g. TRL's
    # importance-sampling ratio, 0 on a sequence its mask dropped); None: weight 1. They
    # travel with the group, so a replayed row is weighted as its fresh step weighted it.
    token_weights: Tensor | None = None

    TENSORS: ClassVar[tuple[str, ...]] = (
        "input_ids", "attention_mask", "loss_mask", "gen_logprobs", "rewards", "advantages"
    )  # fmt: skip
    OPTIONAL_TENSORS: ClassVar[tuple[str, ...]] = ("token_weights",)

    @property
    def num_tokens(self) -> int:
        """Policy tokens in the group (the loss mask's sum)."""
        return int(self.loss_mask.sum().item())

    @property
    def all_zero_advantage(self) -> bool:
        return bool((self.advantages == 0).all().item())

    @classmethod
    def stack(cls, groups: Sequence[GroupTensors]) -> GroupTensors:
        """The rows of `groups`, group after group: `[N, T]` left padded to the widest (zeros
        on the left), `[N]`; token weights where every group has them."""

        def rows(name: str) -> Tensor:
            parts = [getattr(g, name) for g in groups]
            return torch.cat(parts) if parts[0].dim() == 1 else concat_left_padded(parts)

        weighted = all(g.token_weights is not None for g in groups)
        return cls(
            **{name: rows(name) for name in cls.TENSORS},
            token_weights=rows("token_weights") if weighted else None,
        )

    def take(self, rows: slice) -> GroupTensors:
        """The rows `rows` (one group's, of a stack), trimmed to their own longest row."""
        width = int(self.attention_mask[rows].sum(dim=1).max())
        own = (rows, slice(self.input_ids.shape[1] - width, None))
        weights = None if self.token_weights is None else self.token_weights[own]
        return GroupTensors(
            input_ids=self.input_ids[own],
            attention_mask=self.attention_mask[own],
            loss_mask=self.loss_mask[own],
            gen_logprobs=self.gen_logprobs[own],
            rewards=self.rewards[rows],
            advantages=self.advantages[rows],
            token_weights=weights,
        )


@dataclass(kw_only=True)
class StoredGroup(GroupTensors):
    """One GRPO group as kept in the buffer: its tensors (on the CPU) and its place in the
    lifecycle."""

    group_id: str
    headroom: float  # stored priority, refreshed whenever the group is scanned
    entered_step: int
    replay_count: int = 0
    initial_headroom: float = float("nan")

    def __post_init__(self) -> None:
        if math.isnan(self.initial_headroom):
            self.initial_headroom = self.headroom

    META: ClassVar[tuple[str, ...]] = (
        "group_id", "headroom", "entered_step", "replay_count", "initial_headroom"
    )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Its metadata and, under `tensors`, its tensors (the optional ones when present)."""
        names = self.TENSORS + self.OPTIONAL_TENSORS
        tensors = {n: getattr(self, n).contiguous() for n in names if getattr(self, n) is not None}
        return {**{name: getattr(self, name) for name in self.META}, "tensors": tensors}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> StoredGroup:
        tensors = state["tensors"]
        return cls(
            **{name: tensors[name] for name in cls.TENSORS},
            **{name: tensors.get(name) for name in cls.OPTIONAL_TENSORS},
            **{name: state[name] for name in cls.META},
        )


def make_group(group_id: str, tensors: GroupTensors, step: int) -> StoredGroup:
    """A `StoredGroup` made at `step` whose stored headroom is computed from its
    generation-time log-probs; its float tensors in float32."""
    t = tensors
    h = float(headroom(t.gen_logprobs, t.loss_mask, t.advantages).item())
    return StoredGroup(
        group_id=group_id,
        input_ids=t.input_ids,
        attention_mask=t.attention_mask,
        loss_mask=t.loss_mask.float(),
        gen_logprobs=t.gen_logprobs.float(),
        rewards=t.rewards.float(),
        advantages=t.advantages.float(),
        headroom=h,
        entered_step=step,
        initial_headroom=h,
        token_weights=None if t.token_weights is None else t.token_weights.float(),
    )


class ReplayBuffer:
    """FIFO of whole groups with capacity `C`: the oldest group leaves first, whatever its
    priority. Iteration is oldest first."""

    def __init__(self, capacity: int, groups: Iterable[StoredGroup] = ()) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._groups: deque[StoredGroup] = deque()
        for group in groups:
            self.add(group)

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[StoredGroup]:
        return iter(self._groups)

    def groups(self) -> list[StoredGroup]:
        return list(self._groups)

    def add(self, group: StoredGroup) -> list[StoredGroup]:
        """Append `group`; return the groups evicted to stay within capacity (oldest first)."""
        self._groups.append(group)
        evicted = []
        while len(self._groups) > self.capacity:
            evicted.append(self._groups.popleft())
        return evicted

    def ingest(
        self, groups: Iterable[StoredGroup], store_zero_advantage: bool = False
    ) -> list[StoredGroup]:
        """Ingress after the update: add each group (skipping all-zero-advantage groups unless
        `store_zero_advantage`); return the evicted groups."""
        evicted: list[StoredGroup] = []
        for group in groups:
            if group.all_zero_advantage and not store_zero_advantage:
                continue
            evicted.extend(self.add(group))
        return evicted
