"""The replay lifecycle, owned in one place: `GroupReplay` (store, select, gate, ingest, state).

    replay = GroupReplay(capacity=64, rule="headroom_drift", budget=8, tau=0.05)
    picked = replay.select(step, score, fresh)  # the rule, with the gate's tau; the gate
                                                # then learns from what the scan measured
    ...one update on fresh + picked.groups (`assemble_batch`)...
    replay.ingest(fresh)                        # after the update: the picked groups count one
                                                # more replay; whole fresh groups enter, FIFO
    torch.save(replay.state_dict(), path)       # or replay.save(path): one format, for every
    replay.load_state_dict(torch.load(path, weights_only=True))   # trainer that holds one

It owns the buffer, the replay rule, the replay scan's drift gate and, for rollouts that run
ahead of the trainer, the staleness gate of late groups (`late`, `admit_late`): the state of
all of them is one `state_dict`. hdr's loop, its TRL trainer and its veRL rows all store,
select and restore through it; nothing else holds a copy of the buffer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from headroom_drift.gates import FixedGate, Gate
from headroom_drift.groups import GroupTensors, ReplayBuffer, StoredGroup, make_group
from headroom_drift.objective import group_advantages
from headroom_drift.rules import replay_rule
from headroom_drift.selection import (
    Candidate,
    ScoreFn,
    Selection,
    by_recency,
    eligible,
    survey,
)
from headroom_drift.staleness import LateDecision, admit_late, staleness_rule

STATE_FORMAT = "headroom_drift.GroupReplay"
STATE_VERSION = 1
# what a process's selection tells the others (`GroupReplay.decided_by`), beside its group ids
AGREED = (
    "weights", "swap_out", "scanned", "drift_scanned", "admitted_scanned", "headroom_scanned",
    "drift_admitted", "headroom_stored", "headroom_refreshed",
)  # fmt: skip


@dataclass
class LateGroups:
    """How late groups of an asynchronous rollout are admitted (`headroom_drift.staleness`):
    the rule's name, the gate whose tau a drift rule reads, the hard version cap, the drift
    norm, and whether a rejected group enters the buffer (else it is dropped)."""

    rule: str = "version_bound"
    gate: Gate = field(default_factory=lambda: FixedGate(math.inf))
    max_lag: int = 0
    norm: str = "l2"
    keep_rejected: bool = True

    def __post_init__(self) -> None:
        staleness_rule(self.rule)  # an unknown name lists the valid ones


def gate_state(gate: Gate) -> dict[str, Any]:
    """A gate's tau and, if it has state of its own, its `state_dict()`."""
    return {
        "tau": float(gate.tau),
        "state": gate.state_dict() if hasattr(gate, "state_dict") else None,
    }


def restore_gate(gate: Gate, state: dict[str, Any] | None) -> None:
    """Restore what `gate_state` returned. A gate without state of its own (`FixedGate`)
    keeps the tau it was built with, so a resumed run can change it by config."""
    if state and state.get("state") is not None and hasattr(gate, "load_state_dict"):
        gate.load_state_dict(state["state"])


class GroupReplay:
    """A FIFO buffer of whole GRPO groups, a replay rule, a drift gate, and the step's pending
    selection (from `select` until `ingest`).

    `rule`: a name in `headroom_drift.RULES` (`headroom_drift`, `headroom_drift_l1`,
    `headroom_only`, `drift_only`, `replay_recency`, `on_policy`, `replay_freshness_per`,
    `replay_zero_variance_swap`); `params`: the fields of that rule's params dataclass, e.g.
    `budget` (R), `tau`, `norm`, `chunk` for the Headroom-Drift family. `gate`: where tau
    comes from at each selection (default `FixedGate(params' tau)`); giving both a gate and a
    `tau` is refused. `store_zero_advantage`: keep groups whose advantages are all 0. `late`:
    the staleness rule and gate of late groups (`admit_late`), when rollouts run ahead.
    """

    def __init__(
        self,
        capacity: int,
        rule: str = "headroom_drift",
        gate: Gate | None = None,
        store_zero_advantage: bool = False,
        late: LateGroups | None = None,
        **params,
    ) -> None:
        if gate is not None and "tau" in params:
            raise ValueError("give the drift gate's tau to the gate, not as a rule parameter")
        self.rule_name = rule
        self.rule = replay_rule(rule)
        self.params = self.rule.params_type(**params)
        self.gate: Gate = (
            gate if gate is not None else FixedGate(getattr(self.params, "tau", math.inf))
        )
        self.store_zero_advantage = store_zero_advantage
        self.late = late
        self.buffer = ReplayBuffer(capacity)
        self.pending: Selection | None = None  # selected, not yet ingested
        self.stored = 0  # groups offered to `store`, for default names

    @classmethod
    def from_params(
        cls, capacity: int, rule: str, params, gate: Gate | None = None,
        store_zero_advantage: bool = False, late: LateGroups | None = None,
    ) -> GroupReplay:  # fmt: skip
        """From a rule's params dataclass (`headroom_drift.rule_params`); the gate defaults to
        `FixedGate(params.tau)`."""
        values = asdict(params)
        if gate is not None:
            values.pop("tau", None)
        return cls(capacity, rule, gate, store_zero_advantage, late, **values)

    def __len__(self) -> int:
        return len(self.buffer)

    # --- read-only views -------------------------------------------------------------------

    @property
    def tau(self) -> float:
        """The replay gate's tau now: what the next `select` admits by."""
        return float(self.gate.tau)

    @property
    def gate_measured(self) -> float:
        """What an adaptive gate measured at the last selection (NaN before the first, and
        for a gate that measures nothing)."""
        return getattr(self.gate, "last_measured", math.nan)

    def groups(self) -> tuple[StoredGroup, ...]:
        """The stored groups, oldest first: a snapshot (only `ingest` changes the buffer)."""
        return tuple(self.buffer)

    def decided_by(self, broadcast: Callable[[Any], Any]) -> Callable[[Selection], Selection]:
        """An `agree` for `select` across processes: the selection of the process whose value
        `broadcast` hands every process (rank 0's), taken by each from its own copy of the
        buffer by group id, with the weights, the swaps and what the scan saw (the scan's
        log-probs, `scored`, stay each process's own). Every process must ingest alike."""

        def agree(selection: Selection) -> Selection:
            ids, values = broadcast(
                ([g.group_id for g in selection.groups],
                 {name: getattr(selection, name) for name in AGREED})
            )  # fmt: skip
            by_id = {g.group_id: g for g in self.buffer}
            missing = [i for i in ids if i not in by_id]
            if missing:  # the buffers differ: cannot happen while every process ingests alike
                raise RuntimeError(f"this process's replay buffer lacks groups {missing}")
            return Selection(groups=[by_id[i] for i in ids], **values)

        return agree

    # --- select and gate -------------------------------------------------------------------

    def select(
        self,
        step: int,
        score: ScoreFn,
        fresh: Sequence[StoredGroup] = (),
        agree: Callable[[Selection], Selection] | None = None,
    ) -> Selection:
        """The stored groups to replay at `step` (`Selection.groups`, with what the scan saw),
        held as pending until `ingest`.

        `score(groups) -> [Tensor[G, T]]`: the current policy's log-probs of each group's
        tokens, teacher forced without gradient, aligned with its `input_ids`. Groups made at
        `step` or later are never picked. The rule's tau is the gate's now; the gate then sees
        the scanned drifts and which were admitted. `agree`: across processes, turns this
        process's selection into the one every process uses (e.g. rank 0's, broadcast), before
        the gate learns from it, so the gates stay equal too."""
        params = self.params
        if any(f.name == "tau" for f in fields(params)):
            params = replace(params, tau=float(self.gate.tau))
        selection = self.rule(self.buffer, step, params, score, fresh)
        if agree is not None:
            selection = agree(selection)
        self.gate.update(
            torch.tensor(selection.drift_scanned, dtype=torch.float32),
            torch.tensor(selection.admitted_scanned, dtype=torch.bool),
        )
        self.pending = selection
        return selection

    def survey(self, step: int, score: ScoreFn, newest: int | None = None) -> list[Candidate]:
        """The stored groups eligible at `step` (entered before it) as the current policy sees
        them, newest first, changing nothing: all of them, or the `newest` few (what
        `replay_recency` replays with that budget). Call it before `select` or after, at the
        same weights; `score` as in `select`, in the rule's chunks and drift norm."""
        groups = by_recency(eligible(self.buffer, step))
        if newest is not None:
            groups = groups[:newest]
        norm = getattr(self.params, "norm", "l2")
        return survey(groups, step, norm, score, getattr(self.params, "chunk", 8))

    def admit_late(
        self, fresh: Sequence[StoredGroup], sampled: Sequence[Tensor], lags: list[int]
    ) -> LateDecision:
        """The staleness rule (`late`) over a step's fresh groups, each `lags[k]` updates late:
        `fresh[k].gen_logprobs` teacher forced under the current weights, `sampled[k]` the
        sampler's `[G, T_k]`. Late groups take the sampler's log-probs as behaviour log-probs;
        a rejected one is to be ingested beside the fresh ones (`LateDecision.to_buffer`), or
        dropped. The staleness gate learns from the late groups' drifts."""
        if self.late is None:
            raise ValueError("admit_late needs the staleness settings: GroupReplay(late=...)")
        late = self.late
        rule = staleness_rule(late.rule)
        return admit_late(
            rule, late.gate, fresh, sampled, lags, late.max_lag, late.norm, late.keep_rejected
        )

    # --- ingest ----------------------------------------------------------------------------

    def ingest(self, fresh: Sequence[StoredGroup]) -> list[StoredGroup]:
        """Ingress after the update: the pending selection's groups count one more replay
        (once), then `fresh` enter the buffer (all-zero-advantage groups only with
        `store_zero_advantage`). Returns the groups evicted, oldest first."""
        if self.pending is not None:
            for group in self.pending.groups:
                group.replay_count += 1
            self.pending = None
        return self.buffer.ingest(fresh, self.store_zero_advantage)

    def make(
        self,
        step: int,
        input_ids: Tensor,
        attention_mask: Tensor,
        loss_mask: Tensor,
        logprobs: Tensor,
        rewards: Tensor,
        advantages: Tensor | None = None,
        group_id: str | None = None,
        token_weights: Tensor | None = None,
    ) -> StoredGroup:
        """One group made at `step`, from plain tensors, to train on now and `ingest` after
        the update.

        `input_ids`, `attention_mask`, `loss_mask`, `logprobs`: `[G, T]`, left padded, each
        column aligned with `input_ids` (`loss_mask` 1 on the policy's tokens, `logprobs` the
        behaviour log-probs of those tokens, which a replay update divides by); `rewards`:
        `[G]`; `advantages`: `[G]`, by default `(r - mean) / (std + 1e-6)`; `token_weights`
        `[G, T]`: the fresh step's per-token weights, kept with the group. Named
        `s{step}/{k}` unless `group_id` is given."""
        if advantages is None:
            advantages = group_advantages(rewards.unsqueeze(0))[0]
        self.stored += 1
        tensors = GroupTensors(
            input_ids, attention_mask, loss_mask, logprobs, rewards, advantages, token_weights
        )
        return make_group(group_id or f"s{step}/{self.stored - 1}", tensors, step)

    def store(self, step: int, *args, **kwargs) -> StoredGroup | None:
        """`make` a group (same arguments) and ingest it at once (call it after that step's
        update). Returns the group, or None when it was not kept (all advantages 0 without
        `store_zero_advantage`)."""
        group = self.make(step, *args, **kwargs)
        kept = not group.all_zero_advantage or self.store_zero_advantage
        self.ingest([group])
        return group if kept else None

    # --- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything to continue exactly, as plain values and tensors (what
        `torch.load(..., weights_only=True)` reads back): the buffer's groups, the capacity,
        the rule's name, the gates' states. Call it between steps (nothing pending)."""
        if self.pending is not None:
            raise ValueError("state_dict between steps only: a selection awaits its ingest")
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "capacity": self.buffer.capacity,
            "rule": self.rule_name,
            "stored": self.stored,
            "gate": gate_state(self.gate),
            "late_gate": None if self.late is None else gate_state(self.late.gate),
            "groups": [group.state_dict() for group in self.buffer],
        }

    def load_state_dict(self, state: dict[str, Any]) -> list[StoredGroup]:
        """Restore what `state_dict` returned. The rule, its params, a fixed gate's tau and the
        capacity stay this object's (a resumed run may change them by config): groups beyond
        a smaller capacity leave, the oldest first, and are returned (oldest first)."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a {STATE_FORMAT} state")
        if state.get("version", 0) > STATE_VERSION:
            raise ValueError(
                f"a {STATE_FORMAT} state of version {state['version']}: newer than this one"
                f" ({STATE_VERSION})"
            )
        groups = [StoredGroup.from_state_dict(g) for g in state["groups"]]
        self.buffer = ReplayBuffer(self.buffer.capacity)
        left = [g for group in groups for g in self.buffer.add(group)]
        self.stored = int(state["stored"])
        restore_gate(self.gate, state["gate"])
        if self.late is not None:
            restore_gate(self.late.gate, state.get("late_gate"))
        self.pending = None
        return left

    def save(self, path: str | Path) -> Path:
        """`state_dict()` to `path` (torch's format), whole or not at all: written beside it
        under a temporary name, then renamed over it."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)
        return path

    def load(self, path: str | Path) -> list[StoredGroup]:
        """Restore a `save`d state (read with `weights_only=True`: tensors and plain values
        only, never arbitrary pickled objects); returns what `load_state_dict` returns."""
        return self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
