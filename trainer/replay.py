"""Headroom-Drift Replay: the two scores, the FIFO group buffer and the replay selectors.

What is implemented (docs/design.md, normative). A stored group holds one prompt's `G` responses
as left-padded token ids with the loss mask `m`, the generation-time log-probs, rewards and
advantages, all aligned with `input_ids` (`loss_mask[i, t]` and `gen_logprobs[i, t]` refer
to token `input_ids[i, t]`; column 0 is never a policy token).

- Headroom, per token `h = 1 - p` where `A > 0` and `h = p` where `A < 0` (`p = exp(logprob)`);
  `H(g)` is the masked token mean over responses with `A != 0`, 0 when every `A` is 0.
- Policy Drift `D(g)`: masked token mean over all responses of
  `(logprob_current - gen_logprob)^2` (L2, default) or `|logprob_current - gen_logprob|` (L1).
- Buffer: FIFO of whole groups, capacity `C`; the oldest leaves first whatever its priority.
- Selection each step: order by stored headroom (highest first), scan in chunks, score each
  candidate teacher-forced under the current policy (no grad) through an injected scoring
  callable, compute `D`, refresh the stored headroom from the same log-probs, admit when
  `D <= tau`, stop at the budget `R` or when the buffer is exhausted.

The comparison arms are one table, `ORDERED_ARMS`, each an `OrderedReplay`: ordering x
re-scoring x gate x norm, all sharing that scan: `on_policy` (no replay), `replay_recency`
(the R newest groups, no scoring, no gate), `headroom_only` (headroom order, no gate),
`drift_only` (recency order, gated), `headroom_drift` (headroom order, gated, norm from the
config, L2 by default), `headroom_drift_l1` (the same with the L1 gate). Two published GRPO
replay rules are `SampledReplay`s (random draws by a score, no re-scoring):
`replay_freshness_per` and `replay_zero_variance_swap`. Every rule is in `RULES` by name
(`trainer.selectors` registers them for configs) and reads its own small params dataclass
(`ScanParams`, `FreshnessParams`, `SwapParams`).

Departures from the paper: the scan's chunk is never larger than the number of slots still
open, so the scan never scores a candidate it could not admit; candidates that entered at or
after the current step are skipped (ingress happens after the update, so in the training loop
there are none). The initial stored headroom is computed from the generation-time log-probs.

This module is pure tensor code: it imports torch and `trainer.grpo` only and knows nothing
of models, HTTP or config, so another trainer can lift it (docs/integrations.md).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.grpo import masked_mean

DRIFT_NORMS = ("l2", "l1")


def headroom(logprobs: Tensor, mask: Tensor, advantages: Tensor) -> Tensor:
    """Group headroom `H(g)` under the policy that gave `logprobs`.

    `logprobs`, `mask`: `[G, T]`; `advantages`: `[G]`. Per token `h = 1 - p` if `A > 0`,
    `h = p` if `A < 0` (`p = exp(logprobs)`); returns the masked token mean of `h` over the
    responses with `A != 0` (a scalar), and 0 when every `A` is 0.
    """
    p = torch.exp(logprobs.float())  # (G, T)
    adv = advantages.to(p.dtype).unsqueeze(-1)  # (G, 1)
    h = torch.where(adv > 0, 1.0 - p, p)
    active = mask.to(p.dtype) * (adv != 0).to(p.dtype)  # (G, T)
    return masked_mean(h, active)


def policy_drift(logprobs: Tensor, gen_logprobs: Tensor, mask: Tensor, norm: str = "l2") -> Tensor:
    """Policy Drift `D(g)` between the current and the generation-time policy.

    `logprobs`, `gen_logprobs`, `mask`: `[G, T]`. Returns the masked token mean over all
    responses of `(logprobs - gen_logprobs)^2` (`norm="l2"`) or `|logprobs - gen_logprobs|`
    (`norm="l1"`), a scalar.
    """
    diff = logprobs.float() - gen_logprobs.float()
    if norm == "l2":
        per_token = diff.square()
    elif norm == "l1":
        per_token = diff.abs()
    else:
        raise ValueError(f"drift norm must be one of {DRIFT_NORMS}, got {norm!r}")
    return masked_mean(per_token, mask)


@dataclass
class GroupTensors:
    """A GRPO group's tensors, each aligned with its `input_ids` (`loss_mask[i, t]` and
    `gen_logprobs[i, t]` refer to token `input_ids[i, t]`): `[G, T]`, left padded, or `[G]`.
    What a group is to the formulas; it travels as one value from the scoring helpers to
    `make_group`, `GroupReplay.store` and an update's rows. Several groups' rows stacked to one
    width are one value too (`stack`; `take` cuts one group back out)."""

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
            if parts[0].dim() == 1:
                return torch.cat(parts)
            width = max(t.shape[1] for t in parts)
            return torch.cat([F.pad(t, (width - t.shape[1], 0)) for t in parts], dim=0)

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

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._groups: deque[StoredGroup] = deque()

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self):
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

    def state(self) -> tuple[dict[str, Tensor], list[dict]]:
        """Tensors (keyed `"{i}.{name}"`) and per-group metadata, for safetensors + JSON."""
        tensors: dict[str, Tensor] = {}
        meta: list[dict] = []
        for i, group in enumerate(self._groups):
            for name in StoredGroup.TENSORS + StoredGroup.OPTIONAL_TENSORS:
                if getattr(group, name) is not None:
                    tensors[f"{i}.{name}"] = getattr(group, name).contiguous()
            meta.append({name: getattr(group, name) for name in StoredGroup.META})
        return tensors, meta

    @classmethod
    def from_state(cls, capacity: int, tensors: dict[str, Tensor], meta: list[dict]):
        buffer = cls(capacity)
        for i, info in enumerate(meta):
            arrays = {name: tensors[f"{i}.{name}"] for name in StoredGroup.TENSORS}
            for name in StoredGroup.OPTIONAL_TENSORS:
                arrays[name] = tensors.get(f"{i}.{name}")
            buffer._groups.append(StoredGroup(**arrays, **info))
        return buffer


# --- selection -----------------------------------------------------------------------------

ScoreFn = Callable[[Sequence[StoredGroup]], list[Tensor]]
"""Scores groups teacher-forced under the current policy: returns one `[G, T]` log-prob
tensor per group, aligned with the group's `input_ids`. Selection uses their values only; a
score may keep their graphs for the update to reuse (`replay.reuse_scan_forward`)."""


@dataclass(frozen=True)
class ScanParams:
    """The Headroom-Drift family's knobs: budget `R`, drift gate `tau`, drift norm, and the
    most candidates scored at once (groups)."""

    budget: int
    tau: float = math.inf
    norm: str = "l2"
    chunk: int = 8


@dataclass(frozen=True)
class FreshnessParams:
    """Freshness-aware prioritized replay: budget `R`, the age scale `tau_age` (steps) of the
    priority's decay, the importance exponent at step 0 (annealed to 1 over the run's
    `total_steps`), and the seed its draws depend on."""

    budget: int
    tau_age: float = 500.0
    is_beta_start: float = 0.4
    total_steps: int = 1
    seed: int = 0


@dataclass(frozen=True)
class SwapParams:
    """Zero-variance swap: the seed its draws depend on (as many swaps as flat fresh groups)."""

    seed: int = 0


def step_generator(seed: int, step: int) -> torch.Generator:
    """A torch RNG for `step` that depends only on (seed, step), so a resumed run draws what
    the original would have."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


@dataclass
class Selection:
    """The admitted groups and what the scan saw (for telemetry)."""

    groups: list[StoredGroup] = field(default_factory=list)
    scanned: int = 0
    drift_scanned: list[float] = field(default_factory=list)
    admitted_scanned: list[bool] = field(default_factory=list)  # per scanned candidate
    headroom_scanned: list[float] = field(default_factory=list)  # refreshed values
    drift_admitted: list[float] = field(default_factory=list)
    headroom_stored: list[float] = field(default_factory=list)  # admitted, before refresh
    headroom_refreshed: list[float] = field(default_factory=list)  # admitted, after refresh
    weights: list[float] = field(default_factory=list)  # importance weight per group (1 if empty)
    swap_out: list[int] = field(default_factory=list)  # fresh groups left out of the update
    # admitted groups' scan log-probs, with their graphs if the score kept them
    scored: list[Tensor] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Admitted / scanned; NaN when nothing was scanned."""
        return len(self.groups) / self.scanned if self.scanned else float("nan")


class Selector(Protocol):
    """Picks stored groups for `step`. `params` is an instance of the rule's `params_type`;
    `fresh` are the step's own groups (not yet stored): only the zero-variance swap looks at
    them."""

    params_type: type

    def __call__(
        self,
        buffer: ReplayBuffer,
        step: int,
        params,
        score: ScoreFn,
        fresh: Sequence[StoredGroup] = (),
    ) -> Selection: ...


def eligible(buffer: ReplayBuffer, step: int) -> list[StoredGroup]:
    """Groups that entered before `step` (never the step's own groups), oldest first."""
    return [g for g in buffer if g.entered_step < step]


def by_recency(groups: Sequence[StoredGroup]) -> list[StoredGroup]:
    """Newest first (latest entry step; among equals, the later-added first)."""
    return list(reversed(groups))


def by_headroom(groups: Sequence[StoredGroup]) -> list[StoredGroup]:
    """Highest stored headroom first; ties go to the newer group."""
    newest_first = by_recency(groups)
    return sorted(newest_first, key=lambda g: -g.headroom)  # stable: keeps newest first


def scan(
    candidates: Sequence[StoredGroup],
    budget: int,
    tau: float,
    norm: str,
    score: ScoreFn,
    chunk: int,
) -> Selection:
    """Scan `candidates` in order, in chunks: score each under the current policy, compute
    `D(g)`, refresh its stored headroom from the same log-probs, admit if `D(g) <= tau`; stop
    once `budget` groups are admitted or the candidates are exhausted. A chunk never holds
    more candidates than there are open slots."""
    sel = Selection()
    i = 0
    while len(sel.groups) < budget and i < len(candidates):
        size = max(1, min(chunk, budget - len(sel.groups)))
        batch = candidates[i : i + size]
        i += size
        for group, logprobs in zip(batch, score(batch), strict=True):
            values = logprobs.detach()  # a score may carry its graph (kept in `scored`)
            drift = float(policy_drift(values, group.gen_logprobs, group.loss_mask, norm))
            stored = group.headroom
            group.headroom = float(headroom(values, group.loss_mask, group.advantages))
            sel.scanned += 1
            sel.drift_scanned.append(drift)
            sel.headroom_scanned.append(group.headroom)
            sel.admitted_scanned.append(drift <= tau)
            if drift <= tau:
                sel.groups.append(group)
                sel.drift_admitted.append(drift)
                sel.headroom_stored.append(stored)
                sel.headroom_refreshed.append(group.headroom)
                sel.scored.append(logprobs)
    return sel


@dataclass(frozen=True)
class OrderedReplay:
    """An arm of the Headroom-Drift family, as ordering x re-scoring x gate x norm.

    The stored groups that entered before the step, in `order` (None: replay nothing). With
    `rescore`, candidates are scanned (`scan`): scored under the current policy, their
    headroom refreshed, and, when `gated`, admitted only if `D(g) <= tau` in `norm` (None: the
    configured norm). Without it the first `R` are taken as stored (no scoring)."""

    order: Callable[[Sequence[StoredGroup]], list[StoredGroup]] | None
    rescore: bool = True
    gated: bool = True
    norm: str | None = None
    params_type: ClassVar[type] = ScanParams

    def __call__(
        self, buffer: ReplayBuffer, step: int, params: ScanParams, score: ScoreFn, fresh=()
    ) -> Selection:
        if self.order is None:
            return Selection()
        candidates = self.order(eligible(buffer, step))
        if not self.rescore:
            groups = candidates[: params.budget]
            return Selection(groups=groups, headroom_stored=[g.headroom for g in groups])
        tau = params.tau if self.gated else math.inf
        return scan(candidates, params.budget, tau, self.norm or params.norm, score, params.chunk)


# The comparison arms of the paper, in one table (docs/design.md):
#              ordering     re-scored  gated   norm
ORDERED_ARMS = {
    "on_policy": OrderedReplay(None, rescore=False, gated=False),
    "replay_recency": OrderedReplay(by_recency, rescore=False, gated=False),
    "headroom_only": OrderedReplay(by_headroom, rescore=True, gated=False),
    "drift_only": OrderedReplay(by_recency, rescore=True, gated=True),
    "headroom_drift": OrderedReplay(by_headroom, rescore=True, gated=True),
    "headroom_drift_l1": OrderedReplay(by_headroom, rescore=True, gated=True, norm="l1"),
}
# --- published replay rules for GRPO (no re-scoring, stored behaviour log-probs) -----------


def freshness_priority(rewards: Tensor, age: Tensor, tau_age: float) -> Tensor:
    """Freshness-aware priority of stored groups: `mean_i |r[g, i]| * exp(-age[g] / tau_age)`.

    `rewards`: `[n, G]`; `age`: `[n]` steps since the group entered. Returns `[n]`. The
    published rule scores one trajectory by `|reward| * exp(-age / tau_age)`; a group's
    priority here is the mean of its responses' scores, since replay moves whole groups.
    """
    return rewards.abs().float().mean(dim=-1) * torch.exp(-age.float() / tau_age)


def importance_weights(probs: Tensor, picked: Tensor, beta: float) -> Tensor:
    """Prioritized-replay importance weights of the picked items, normalised by their max.

    `probs`: `[n]` sampling probabilities over the whole buffer; `picked`: `[k]` indices.
    `w = (n * P(i)) ** -beta / max w` (Schaul et al.'s correction; beta annealed to 1).
    """
    w = (len(probs) * probs[picked]).pow(-beta)
    return w / w.max()


def zero_variance_swap_score(rewards: Tensor, advantages: Tensor) -> Tensor:
    """Swap score of stored groups: `sum_i |A[g, i]| * std_i r[g]` (Bessel). `[n, G]` -> `[n]`."""
    return advantages.abs().float().sum(dim=-1) * rewards.float().std(dim=-1, unbiased=True)


def sample_proportional(scores: Tensor, k: int, rng: torch.Generator) -> Tensor:
    """`k` distinct indices drawn in proportion to `scores` (>= 0); fewer when fewer are
    positive. Returns `[k']` int64."""
    positive = int((scores > 0).sum())
    k = min(k, positive)
    if k == 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.multinomial(scores.double(), k, replacement=False, generator=rng)


@dataclass(frozen=True)
class SampledReplay:
    """A published GRPO replay rule: stored groups drawn at random by a score of their own,
    replayed with their stored log-probs (no re-scoring, no gate). `draw(groups, step,
    params, fresh)` sees the groups that entered before the step, oldest first."""

    draw: Callable[..., Selection]
    params_type: type

    def __call__(self, buffer: ReplayBuffer, step: int, params, score: ScoreFn, fresh=()):
        return self.draw(eligible(buffer, step), step, params, fresh)


def draw_by_freshness(
    groups: list[StoredGroup], step: int, params: FreshnessParams, fresh=()
) -> Selection:
    """Freshness-aware prioritized replay: `R` groups sampled without replacement in proportion
    to `freshness_priority`, importance weights with exponent annealed linearly from
    `is_beta_start` to 1 over the run."""
    if not groups or params.budget == 0:
        return Selection()
    rewards = torch.stack([g.rewards for g in groups])  # (n, G)
    age = torch.tensor([step - g.entered_step for g in groups])  # (n,)
    priority = freshness_priority(rewards, age, params.tau_age)
    picked = sample_proportional(priority, params.budget, step_generator(params.seed, step))
    if len(picked) == 0:
        return Selection()
    progress = min(1.0, step / max(1, params.total_steps))
    beta = params.is_beta_start + (1.0 - params.is_beta_start) * progress
    weights = importance_weights(priority / priority.sum(), picked, beta)
    chosen = [groups[int(i)] for i in picked]
    return Selection(
        groups=chosen,
        headroom_stored=[g.headroom for g in chosen],
        weights=[float(w) for w in weights],
    )


def draw_for_flat_groups(
    groups: list[StoredGroup], step: int, params: SwapParams, fresh=()
) -> Selection:
    """Zero-variance swap: each fresh group whose rewards are all equal (no gradient) is
    replaced by a stored group, drawn without replacement in proportion to
    `zero_variance_swap_score`; as many swaps as there are such groups and stored groups with
    a positive score (the budget `R` does not apply). Departure from TRL's replay-buffer
    GRPO, which keeps a heap of the groups with the best swap score: the draw is from the
    FIFO buffer every arm shares, so every arm sees the same stored groups."""
    flat = [k for k, g in enumerate(fresh) if g.all_zero_advantage]
    if not flat or not groups:
        return Selection()
    scores = zero_variance_swap_score(
        torch.stack([g.rewards for g in groups]), torch.stack([g.advantages for g in groups])
    )
    picked = sample_proportional(scores, len(flat), step_generator(params.seed, step))
    chosen = [groups[int(i)] for i in picked]
    return Selection(
        groups=chosen,
        headroom_stored=[g.headroom for g in chosen],
        swap_out=flat[: len(chosen)],
    )


PUBLISHED_RULES = {
    "replay_freshness_per": SampledReplay(draw_by_freshness, FreshnessParams),
    "replay_zero_variance_swap": SampledReplay(draw_for_flat_groups, SwapParams),
}

RULES: dict[str, Selector] = {**ORDERED_ARMS, **PUBLISHED_RULES}
"""Every replay rule by name (`trainer.selectors.SELECTORS` registers them for configs)."""
