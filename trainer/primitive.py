"""The replay lifecycle, owned in one place: `GroupReplay` (store, select, gate, ingest, state).

    replay = GroupReplay(capacity, rule="headroom_drift", gate=FixedGate(0.05), budget=8)
    sel = replay.select(step, score, fresh)   # rule from trainer.replay.RULES, tau from the gate;
                                              # then gate.update(drifts, admitted)
    ...update on fresh + sel.groups (a group's `token_weights` travel with it)...
    replay.ingest(fresh)                      # after the update: counts sel's replays, stores
                                              # whole groups (all-zero-advantage ones only with
                                              # store_zero_advantage), FIFO-evicts; returns evicted
    replay.store(step, input_ids, ...)        # one group from plain tensors, then `ingest([it])`
    tensors, meta = replay.state(); GroupReplay.from_state(tensors, meta)   # checkpoints

hdr's loop (trainer/loop.py), its TRL trainer (trainer/integrations/trl.py) and the example in
docs/integrations.md all run replay through this class. Pure: imports torch and hdr's tensor
modules only (no config, model or HTTP), so another trainer can lift it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, fields, replace

import torch
from torch import Tensor

from trainer.gate import FixedGate, Gate
from trainer.grpo import group_advantages
from trainer.replay import (
    RULES,
    GroupTensors,
    ReplayBuffer,
    ScoreFn,
    Selection,
    StoredGroup,
    make_group,
)


class GroupReplay:
    """A FIFO buffer of whole GRPO groups, a replay rule, a drift gate, and the step's pending
    selection (from `select` until `ingest`).

    `rule`: a name in `trainer.replay.RULES` (`headroom_drift`, `headroom_drift_l1`,
    `headroom_only`, `drift_only`, `replay_recency`, `on_policy`, `replay_freshness_per`,
    `replay_zero_variance_swap`); `params`: the fields of that rule's params dataclass, e.g.
    `budget` (R), `tau`, `norm`, `chunk` for the Headroom-Drift family. `gate`: where tau
    comes from at each selection (default `FixedGate(params' tau)`); giving both a gate and a
    `tau` is refused. `store_zero_advantage`: keep groups whose advantages are all 0.
    """

    def __init__(
        self,
        capacity: int,
        rule: str = "headroom_drift",
        gate: Gate | None = None,
        store_zero_advantage: bool = False,
        **params,
    ) -> None:
        if rule not in RULES:
            raise ValueError(f"unknown replay rule {rule!r}; valid: {', '.join(RULES)}")
        if gate is not None and "tau" in params:
            raise ValueError("give the drift gate's tau to the gate, not as a rule parameter")
        self.rule_name = rule
        self.rule = RULES[rule]
        self.params = self.rule.params_type(**params)
        tau = getattr(self.params, "tau", float("inf"))
        self.gate: Gate = gate if gate is not None else FixedGate(tau)
        self.store_zero_advantage = store_zero_advantage
        self.buffer = ReplayBuffer(capacity)
        self.pending: Selection | None = None  # selected, not yet ingested
        self.stored = 0  # groups offered to `store`, for default names

    @classmethod
    def from_params(
        cls, capacity: int, rule: str, params, gate: Gate | None = None,
        store_zero_advantage: bool = False,
    ) -> GroupReplay:  # fmt: skip
        """From a rule's params dataclass (`trainer.selectors.select_params`); the gate defaults
        to `FixedGate(params.tau)`."""
        values = asdict(params)
        if gate is not None:
            values.pop("tau", None)
        return cls(capacity, rule, gate, store_zero_advantage, **values)

    def __len__(self) -> int:
        return len(self.buffer)

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
        token_weights: Tensor | None = None,
    ) -> StoredGroup | None:
        """Keep one group made at `step` (call it after that step's update: `ingest`).

        `input_ids`, `attention_mask`, `loss_mask`, `logprobs`: `[G, T]`, left padded, each
        column aligned with `input_ids` (`loss_mask` 1 on the policy's tokens, `logprobs` the
        behaviour log-probs of those tokens, which a replay update divides by); `rewards`:
        `[G]`; `advantages`: `[G]`, by default `(r - mean) / (std + 1e-6)`; `token_weights`
        `[G, T]`: the fresh step's per-token weights, kept with the group. Returns the group,
        or None when it was not kept (all advantages 0 without `store_zero_advantage`)."""
        if advantages is None:
            advantages = group_advantages(rewards.unsqueeze(0))[0]
        self.stored += 1
        tensors = GroupTensors(
            input_ids, attention_mask, loss_mask, logprobs, rewards, advantages, token_weights
        )
        group = make_group(group_id or f"s{step}/{self.stored - 1}", tensors, step)
        kept = not group.all_zero_advantage or self.store_zero_advantage
        self.ingest([group])
        return group if kept else None

    # --- checkpoints -----------------------------------------------------------------------

    def state(self) -> tuple[dict[str, Tensor], dict]:
        """The buffer's tensors (safetensors-ready) and everything else as JSON values: the
        capacity, the rule, per-group metadata, the gate's tau (and its `state_dict()` if it
        has one). Call it between steps (nothing pending)."""
        tensors, groups = self.buffer.state()
        gate = {"tau": float(self.gate.tau)}
        if hasattr(self.gate, "state_dict"):
            gate["state"] = self.gate.state_dict()
        meta = {
            "capacity": self.buffer.capacity,
            "rule": self.rule_name,
            "stored": self.stored,
            "gate": gate,
            "groups": groups,
        }
        return tensors, meta

    def load_state(self, tensors: dict[str, Tensor], meta: dict) -> None:
        """Restore what `state` returned (the rule and its params stay this object's)."""
        self.buffer = ReplayBuffer.from_state(meta["capacity"], tensors, meta["groups"])
        self.stored = int(meta.get("stored", 0))
        gate = meta.get("gate", {})
        # a gate without state of its own (FixedGate) keeps the tau it was built with, so a
        # resumed run can change it by config
        if "state" in gate and hasattr(self.gate, "load_state_dict"):
            self.gate.load_state_dict(gate["state"])
        self.pending = None
