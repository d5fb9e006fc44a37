"""Staleness rules: which late groups of an asynchronous rollout enter the update.

A group sampled by the weights of update `v` and trained at the update after `u` (the
trainer's version) is `lag = u - v` updates late. With rollouts running ahead of the trainer
(`trainer/async_rollout/workers.py`), every fresh group has a lag in `0 .. max_lag`; a late group
(lag >= 1) is, to the drift gate, the same object as a replayed group: its tokens and the
log-probs of an older policy. Its Policy Drift under the current weights is
`D(g) = mean over policy tokens of (logprob_current - logprob_sampler)^2` (L2; L1: `|.|`),
the same `policy_drift` the replay gate reads.

Three rules, registered by name in `STALENESS_RULES` (configs name them as `async_rollout.rule`):

- `version_bound` (AReaL's `max_head_offpolicyness`, TRL's `max_staleness`): admit a group
  when `lag <= max_lag`; drift is measured and logged but not used.
- `drift_gate`: admit a late group when `D(g) <= tau` (a fixed tau), and never one with
  `lag > max_lag` (the hard version cap keeps the queue bounded).
- `adaptive_drift_gate`: the drift gate whose tau follows an `AdaptiveGate`, a controller
  that moves tau in log space after every update to hold a declared target: an acceptance
  rate of late groups, or a drift budget (the mean drift of the late groups admitted).

Every rule admits every on-time group (lag 0): those are the synchronous loop's groups, so a
run whose rollouts are never late is exactly the synchronous loop whatever the rule.

How it departs from the counting rules it is compared with: they decide by the lag alone;
the drift rules pay one teacher-forced pass per late group for the decision (hdr's loop
already runs that pass over every fresh group for the behaviour log-probs, so the pass costs
nothing extra there; the ledger counts it as `cost_gate_tf_tokens`). The gates themselves
(`FixedGate`, `AdaptiveGate`) are `headroom_drift.gates`', shared with the replay scan; the
lifecycle (`GroupReplay.admit_late`) owns the staleness gate beside the replay gate.

`admit_late` applies a rule to a step's fresh groups: an admitted late group trains with the
sampler's log-probs as its behaviour log-probs (the clipped ratio then corrects for the policy
that really sampled it); a rejected one goes to the replay buffer with them, or is dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from headroom_drift.groups import StoredGroup
from headroom_drift.rules import named
from headroom_drift.scores import policy_drift

AdmitFn = Callable[[Tensor, Tensor, float, int], Tensor]
"""`admit(drifts [n], lags [n], tau, max_lag) -> admitted [n] bool`."""


@dataclass(frozen=True)
class StalenessRule:
    """A staleness rule: its admission function and whether its tau adapts online."""

    admit: AdmitFn
    adaptive: bool = False
    uses_drift: bool = True


def version_bound(drifts: Tensor, lags: Tensor, tau: float, max_lag: int) -> Tensor:
    """Admit when `lag <= max_lag` (tau and the drifts unused). `drifts`, `lags`: `[n]`."""
    return lags <= max_lag


def drift_gate(drifts: Tensor, lags: Tensor, tau: float, max_lag: int) -> Tensor:
    """Admit an on-time group always, a late one when `D(g) <= tau` and `lag <= max_lag`.

    `drifts`: `[n]` float, `lags`: `[n]` int. Returns `[n]` bool."""
    on_time = lags <= 0
    return on_time | ((drifts <= tau) & (lags <= max_lag))


STALENESS_RULES: dict[str, StalenessRule] = {
    "version_bound": StalenessRule(version_bound, uses_drift=False),
    "drift_gate": StalenessRule(drift_gate),
    "adaptive_drift_gate": StalenessRule(drift_gate, adaptive=True),
}


def staleness_rule(name: str) -> StalenessRule:
    """The staleness rule called `name` (a ValueError listing the valid names on a miss)."""
    return named(STALENESS_RULES, "staleness rule", name)


@dataclass
class Admission:
    """One step's decision over its fresh groups (`[n]` each, in the step's group order)."""

    lags: Tensor  # int64
    drifts: Tensor  # float32, D(g) under the current weights (0-lag groups included)
    admitted: Tensor  # bool
    tau: float  # the tau the decision used (inf for version_bound)

    @property
    def late(self) -> Tensor:
        return self.lags > 0

    @property
    def late_admitted_share(self) -> float | None:
        """Admitted late groups / late groups; None when none was late."""
        late = self.late
        return float(self.admitted[late].float().mean()) if late.any() else None


def decide(rule: StalenessRule, gate, drifts: Tensor, lags: Tensor, max_lag: int) -> Admission:
    """Apply `rule` with the gate's current tau, then let the gate learn from the late groups
    (on-time groups are admitted by every rule and say nothing about tau)."""
    tau = float(gate.tau) if rule.uses_drift else math.inf
    admitted = rule.admit(drifts, lags, tau, max_lag)
    late = lags > 0
    gate.update(drifts[late], admitted[late])
    return Admission(lags=lags, drifts=drifts, admitted=admitted, tau=tau)


def as_tensors(drifts: list[float], lags: list[int]) -> tuple[Tensor, Tensor]:
    """`[n]` float32 drifts and `[n]` int64 lags."""
    return torch.tensor(drifts, dtype=torch.float32), torch.tensor(lags, dtype=torch.long)


@dataclass
class LateDecision:
    """The step's fresh groups after the staleness rule: those that train, those that go to
    the buffer instead, and what the decision saw."""

    trained: list[StoredGroup]
    to_buffer: list[StoredGroup]
    dropped: int
    admission: Admission | None

    def record(self) -> dict[str, Any] | None:
        """The step's `async_*` metrics (None when nothing was measured: the sync loop)."""
        a = self.admission
        if a is None:
            return None
        late = a.late
        return {
            "rollout_lags": a.lags.tolist(),
            "late_groups": int(late.sum()),
            "late_admitted": int((a.admitted & late).sum()),
            "late_to_buffer": len(self.to_buffer),
            "late_dropped": self.dropped,
            "late_drift": a.drifts[late].tolist(),
            "late_admitted_drift": a.drifts[late & a.admitted].tolist(),
            "late_admitted_share": a.late_admitted_share,
            "staleness_tau": None if a.tau == float("inf") else a.tau,
        }


def admit_late(
    rule: StalenessRule,
    gate,
    fresh: Sequence[StoredGroup],
    sampled: Sequence[Tensor],
    lags: list[int],
    max_lag: int,
    norm: str = "l2",
    keep_rejected: bool = True,
) -> LateDecision:
    """Apply `rule` (with `gate`'s tau) to a step's fresh groups, each `lags[k]` updates late.
    `fresh[k].gen_logprobs` are teacher-forced under the current weights, `sampled[k]` the
    sampler's, aligned `[G, T_k]`; the drift between them (`norm`) is what a drift rule reads.
    Late groups come back as new groups whose behaviour log-probs are the sampler's, admitted
    or not (the groups given are left as they are); a rejected one goes to the buffer with
    `keep_rejected`, else it is dropped (counted)."""
    drifts = [
        float(policy_drift(g.gen_logprobs, s, g.loss_mask, norm))
        for g, s in zip(fresh, sampled, strict=True)
    ]
    admission = decide(rule, gate, *as_tensors(drifts, lags), max_lag)
    trained, rejected = [], []
    for g, s, lag, ok in zip(fresh, sampled, lags, admission.admitted.tolist(), strict=True):
        if lag > 0:  # a new group whose behaviour is the policy that sampled it
            g = replace(g, gen_logprobs=s.float() * g.loss_mask)
        (trained if ok else rejected).append(g)
    if keep_rejected:
        return LateDecision(trained, rejected, 0, admission)
    return LateDecision(trained, [], len(rejected), admission)


def on_time(fresh: list, sampled: list, lags: list[int] | None) -> tuple[list, list]:
    """The fresh groups sampled by the current weights (all of them when `lags` is None):
    the sampler/trainer log-prob gap is measured on these, not on late groups' drift."""
    if lags is None:
        return fresh, sampled
    pairs = [(g, s) for g, s, lag in zip(fresh, sampled, lags, strict=True) if lag == 0]
    return [g for g, _ in pairs], [s for _, s in pairs]
