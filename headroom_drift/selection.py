"""Headroom-Drift selection: which stored groups re-enter training at a step.

What is implemented (docs/design.md, normative): order the stored groups that entered before
the step by stored headroom, highest first; scan in that order, in chunks: score each
candidate teacher-forced under the current policy (no grad) through an injected scoring
callable, compute `D(g)`, refresh its stored headroom from the same log-probs, admit it when
`D(g) <= tau`; stop at the budget `R` or when the candidates are exhausted.

`OrderedReplay` is that scan as ordering x re-scoring x gate x norm, so the paper's comparison
rules (`headroom_drift.rules.ORDERED_RULES`) are rows of one table over the same code.
`Selection` is what any rule returns, this family's or a published one's
(`headroom_drift.published`).

Departures from the paper: the scan's chunk is never larger than the number of slots still
open, so the scan never scores a candidate it could not admit; candidates that entered at or
after the current step are skipped (ingress happens after the update, so in a training loop
there are none). The initial stored headroom is computed from the generation-time log-probs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from torch import Tensor

from headroom_drift.groups import ReplayBuffer, StoredGroup
from headroom_drift.scores import headroom, policy_drift

ScoreFn = Callable[[Sequence[StoredGroup]], list[Tensor]]
"""Scores groups teacher-forced under the current policy: returns one `[G, T]` log-prob
tensor per group, aligned with the group's `input_ids`. Selection uses their values only; a
score may keep their graphs for the update to reuse (hdr's `replay.reuse_scan_forward`)."""


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


class ReplayRule(Protocol):
    """A replay rule: picks stored groups for `step`. `params` is an instance of the rule's
    `params_type`; `fresh` are the step's own groups (not yet stored): only the zero-variance
    swap looks at them."""

    params_type: type

    def __call__(
        self,
        buffer: ReplayBuffer,
        step: int,
        params,
        score: ScoreFn,
        fresh: Sequence[StoredGroup] = (),
    ) -> Selection: ...


@dataclass(frozen=True)
class ScanParams:
    """The Headroom-Drift family's knobs: budget `R`, drift gate `tau`, drift norm, and the
    most candidates scored at once (groups)."""

    budget: int
    tau: float = math.inf
    norm: str = "l2"
    chunk: int = 8


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
class Candidate:
    """A read-only view of one stored group under the current policy: its age at the step,
    `D(g)`, its headroom now and the stored headroom it was ranked by."""

    group_id: str
    age: int
    drift: float
    headroom: float
    stored_headroom: float
    initial_headroom: float


def survey(
    groups: Sequence[StoredGroup], step: int, norm: str, score: ScoreFn, chunk: int
) -> list[Candidate]:
    """Each of `groups` scored under the current policy, in chunks, without admitting or
    changing anything (the stored headroom stays as it was): what a scan would see of them.
    A diagnostic: the admissible pool at any tau, the same-buffer counterfactual of another
    rule's choice."""
    out: list[Candidate] = []
    for i in range(0, len(groups), max(1, chunk)):
        batch = groups[i : i + max(1, chunk)]
        for group, logprobs in zip(batch, score(batch), strict=True):
            values = logprobs.detach()
            out.append(
                Candidate(
                    group_id=group.group_id,
                    age=step - group.entered_step,
                    drift=float(policy_drift(values, group.gen_logprobs, group.loss_mask, norm)),
                    headroom=float(headroom(values, group.loss_mask, group.advantages)),
                    stored_headroom=group.headroom,
                    initial_headroom=group.initial_headroom,
                )
            )
    return out


@dataclass(frozen=True)
class OrderedReplay:
    """A replay rule of the Headroom-Drift family, as ordering x re-scoring x gate x norm.

    The stored groups that entered before the step, in `order` (None: replay nothing). With
    `rescore`, candidates are scanned (`scan`): scored under the current policy, their
    headroom refreshed, and, when `gated`, admitted only if `D(g) <= tau` in `norm` (None: the
    params' norm). Without it the first `R` are taken as stored (no scoring)."""

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
