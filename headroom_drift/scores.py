"""The method's two scores of a stored group (docs/design.md, normative).

- Headroom, per token `h = 1 - p` where `A > 0` and `h = p` where `A < 0` (`p = exp(logprob)`);
  `H(g)` is the masked token mean over the responses with `A != 0`, 0 when every `A` is 0:
  how much room the current policy leaves to move toward its good answers and away from its
  bad ones.
- Policy Drift `D(g)`: the masked token mean over all responses of
  `(logprob_current - gen_logprob)^2` (L2, the default) or `|logprob_current - gen_logprob|`
  (L1): how far the current policy has moved from the one that sampled the group.

Both take the current policy's log-probs of the group's stored tokens, teacher forced, so the
scan that gates a group refreshes its headroom from the same forward pass.
"""

from __future__ import annotations

import torch
from torch import Tensor

from headroom_drift.objective import masked_mean

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
