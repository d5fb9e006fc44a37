"""GRPO's formulas as pure tensor functions: group advantages, the clipped token-level
policy loss, the k3 KL estimator and token entropy.

What is implemented (docs/design.md, normative):

- advantage `A[i] = (r[i] - mean(r)) / (std(r) + 1e-6)` per group, std with Bessel's
  correction, as veRL and TRL compute it;
- loss `-sum(m * min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A)) / sum(m)` with
  `ratio = exp(logprob - old_logprob)`: one token mean over every row of the batch, fresh and
  replayed alike (a replayed row's `old_logprob` is its stored generation-time log-prob);
- a replayed group's advantages scaled by its sampling selector's importance weight
  (`weighted_advantages`; 1 for the other selectors);
- optional KL to a frozen reference with the k3 estimator
  `exp(ref - logprob) - (ref - logprob) - 1`, coefficient `beta` (default 0);
- optional truncated importance sampling of the sampler/trainer mismatch (off by default):
  a fresh token's surrogate is weighted by `w = min(p_trainer / p_sampler, C)`, where
  `p_sampler` is the probability the generation engine reported when it sampled the token
  and `p_trainer` the trainer's teacher-forced one. The large RL frameworks apply this to
  inference-engine samples (vLLM in bf16 does not reproduce the trainer's numbers); the
  weight is a constant (no gradient). `logprob_gap` measures the mismatch it corrects.

Departure from the paper: none in the formulas. A group of one response (G=1) has no defined
sample std; its advantage is 0 rather than NaN.

The functions take plain tensors and know nothing of models.
"""

from __future__ import annotations

import torch
from torch import Tensor

ADV_EPS = 1e-6


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """`sum(mask * values) / sum(mask)`, 0 when the mask is empty. Any matching shapes."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def group_advantages(rewards: Tensor) -> Tensor:
    """Group-relative advantages.

    `rewards`: `[num_groups, G]`. Returns `[num_groups, G]` with
    `A[g, i] = (r[g, i] - mean_i r[g]) / (std_i r[g] + 1e-6)`, std with Bessel's correction
    (divisor G-1). Equal rewards in a group give exactly 0. G=1 gives 0.
    """
    rewards = rewards.to(torch.float32)
    if rewards.shape[-1] < 2:
        return torch.zeros_like(rewards)
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, unbiased=True, keepdim=True)
    return (rewards - mean) / (std + ADV_EPS)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    token_weights: Tensor | None = None,
) -> Tensor:
    """Clipped surrogate loss, token mean over all rows.

    `logprobs`, `old_logprobs`, `mask`: `[N, T]`; `advantages`: `[N]`. With
    `ratio = exp(logprobs - old_logprobs)`:
    `loss = -sum(m * w * min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A)) / sum(m)`,
    `w` = `token_weights` `[N, T]` (e.g. `truncated_is_weights`), 1 when None.
    Returns a scalar; 0 when the mask is empty.
    """
    ratio = torch.exp(logprobs - old_logprobs)  # (N, T)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)  # (N, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    if token_weights is not None:
        surrogate = surrogate * token_weights.to(surrogate.dtype).detach()
    return -masked_mean(surrogate, mask)


def weighted_advantages(advantages: Tensor, weight: float) -> Tensor:
    """A replayed group's advantages scaled by its selector's importance weight `w > 0`
    (`[G]` -> `[G]`). Since `w > 0`, `min(ratio*w*A, clip(ratio)*w*A) = w * min(ratio*A,
    clip(ratio)*A)`: the group's loss terms are scaled by exactly `w`."""
    return advantages * weight


def truncated_is_weights(
    trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, cap: float
) -> Tensor:
    """Truncated importance weights of sampled tokens, `[N, T]` -> `[N, T]`:
    `w = min(exp(trainer_logprobs - sampler_logprobs), cap)` where `mask` is 1, else 1.
    No gradient flows through them."""
    ratio = torch.exp((trainer_logprobs - sampler_logprobs).detach())
    return torch.where(mask.bool(), torch.clamp(ratio, max=cap), torch.ones_like(ratio))


def logprob_gap(logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Sampler vs teacher-forced log-prob gap over `mask` (`[N, T]` each): the mean and the max
    of `|logprobs - sampler_logprobs|` (both 0 for an empty mask)."""
    gap = (logprobs - sampler_logprobs).abs() * mask.to(logprobs.dtype)
    return masked_mean(gap, mask), gap.max() if gap.numel() else gap.sum()


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """k3 estimate of KL(policy || reference), token mean under `mask`.

    Per token `exp(ref - logprob) - (ref - logprob) - 1` (>= 0, unbiased for the KL when
    tokens are sampled from the policy). All arguments `[N, T]`; returns a scalar.
    """
    delta = ref_logprobs - logprobs
    return masked_mean(torch.exp(delta) - delta - 1.0, mask)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution at each position.

    `logits`: `[..., V]`; returns `[...]` with `H = -sum_v softmax(logits)_v * log_softmax_v`.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
