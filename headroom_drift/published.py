"""Two published GRPO replay rules, run on the same buffer as Headroom-Drift's rules so that
every rule of a comparison sees the same stored groups. Neither re-scores: a drawn group is
replayed with its stored behaviour log-probs.

- `replay_freshness_per` (freshness-aware prioritized replay): `R` groups drawn without
  replacement in proportion to `mean_i |r_i| * exp(-age / tau_age)`, with prioritized-replay
  importance weights whose exponent is annealed from `is_beta_start` to 1 over the run.
- `replay_zero_variance_swap` (TRL's experimental replay-buffer GRPO): each fresh group whose
  rewards are all equal is swapped for a stored group drawn in proportion to
  `sum_i |A_i| * std(r)`.

Draws depend only on (seed, step), so a resumed run draws what the original would have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from headroom_drift.groups import ReplayBuffer, StoredGroup
from headroom_drift.selection import ScoreFn, Selection, eligible


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
    FIFO buffer every rule shares, so every rule sees the same stored groups."""
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
