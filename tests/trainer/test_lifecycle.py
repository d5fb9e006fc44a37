"""The replay lifecycle's one owner, `trainer.primitive.GroupReplay`: store, select by a rule,
gate by measured drift through a gate object, ingest after the update, weights that travel with
a stored group, and its state for checkpoints (hand-built groups, no model)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.gate import FixedGate, Gate
from trainer.loop import assemble_batch
from trainer.primitive import GroupReplay
from trainer.replay import GroupTensors, make_group

G, T = 2, 4
MASK = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])


def tensors(seed: int, rewards=(1.0, 0.0)) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(5, 100, (G, T), generator=g),
        "attention_mask": torch.ones(G, T, dtype=torch.long),
        "loss_mask": MASK.clone(),
        "logprobs": -torch.rand(G, T, generator=g) * MASK,
        "rewards": torch.tensor(rewards),
    }


def group_tensors(seed: int) -> GroupTensors:
    """`tensors(seed)` as the value a group is, with advantages +1 and -1."""
    t = tensors(seed)
    return GroupTensors(
        t["input_ids"], t["attention_mask"], t["loss_mask"], t["logprobs"], t["rewards"],
        torch.tensor([1.0, -1.0]),
    )  # fmt: skip


def shifted(offsets: dict[str, float]):
    """A 'current policy' whose log-probs of group g are its stored ones + offsets[g] on the
    policy tokens: L2 drift offsets[g]^2."""

    def score(groups):
        return [g.gen_logprobs + offsets.get(g.group_id, 0.0) * g.loss_mask for g in groups]

    return score


class RecordingGate:
    """A gate with state: it records what each selection measured and halves tau after a
    refusal (any object with `tau` and `update` is a gate)."""

    def __init__(self, tau: float):
        self.tau = tau
        self.seen: list[tuple[list[float], list[bool]]] = []

    def update(self, drifts, admitted):
        self.seen.append((drifts.tolist(), admitted.tolist()))
        if not bool(admitted.all()):
            self.tau /= 2

    def state_dict(self):
        return {"tau": self.tau, "seen": self.seen}

    def load_state_dict(self, state):
        self.tau, self.seen = state["tau"], [tuple(s) for s in state["seen"]]


def test_fixed_gate_is_a_gate_and_learns_nothing():
    gate = FixedGate(0.3)
    assert isinstance(gate, Gate)
    gate.update(torch.tensor([1.0, 0.1]), torch.tensor([False, True]))
    assert gate.tau == 0.3


def test_the_gate_sets_tau_and_sees_each_scan():
    gate = RecordingGate(tau=0.5)
    replay = GroupReplay(8, "headroom_drift", gate=gate, budget=3, chunk=8)
    replay.store(1, **tensors(0), group_id="near")
    replay.store(1, **tensors(1), group_id="far")
    # drifts 0.04 and 0.36: both admitted under 0.5; then tau halves only after a refusal
    sel = replay.select(2, shifted({"near": 0.2, "far": 0.6}))
    assert sorted(g.group_id for g in sel.groups) == ["far", "near"]
    assert gate.seen[-1][1] == [True, True] and gate.tau == 0.5
    gate.tau = 0.1
    sel = replay.select(3, shifted({"near": 0.2, "far": 0.6}))
    assert [g.group_id for g in sel.groups] == ["near"]
    drifts, admitted = gate.seen[-1]
    assert sorted(round(d, 4) for d in drifts) == [0.04, 0.36]
    assert sorted(admitted) == [False, True] and gate.tau == 0.05


def test_a_gate_and_a_rule_tau_together_are_refused():
    with pytest.raises(ValueError, match="gate"):
        GroupReplay(4, "headroom_drift", gate=FixedGate(0.1), budget=1, tau=0.2)


def test_store_zero_advantage_option():
    flat = tensors(0, rewards=(1.0, 1.0))
    assert GroupReplay(4, budget=1).store(1, **flat) is None
    kept = GroupReplay(4, store_zero_advantage=True, budget=1)
    assert kept.store(1, **flat) is not None and len(kept) == 1


def test_ingest_counts_the_selection_once_and_stores_after_the_update():
    replay = GroupReplay(2, "headroom_drift", budget=1, tau=1.0)
    replay.store(1, **tensors(0), group_id="a")
    sel = replay.select(2, shifted({}))
    assert [g.group_id for g in sel.groups] == ["a"] and sel.groups[0].replay_count == 0
    fresh = [make_group(f"s2/{k}", group_tensors(k + 5), 2) for k in range(2)]
    evicted = replay.ingest(fresh)
    assert [g.group_id for g in evicted] == ["a"]  # FIFO, capacity 2
    assert sel.groups[0].replay_count == 1
    replay.ingest([])  # no selection pending: nothing counted twice
    assert sel.groups[0].replay_count == 1


def test_stored_token_weights_travel_into_the_replayed_rows():
    """Defect 7: the fresh step's per-token weights (TRL's importance-sampling ratio, 0 on a
    sequence its mask dropped) stay with the stored group and weight its replayed rows."""
    weights = torch.tensor([[1.0, 1.0, 0.5, 0.7], [1.0, 1.0, 0.0, 0.0]])
    replay = GroupReplay(4, "replay_recency", budget=1)
    replay.store(1, **tensors(0), token_weights=weights, group_id="w")
    sel = replay.select(2, shifted({}))
    fresh = make_group("s2/0", group_tensors(3), 2)
    rows = assemble_batch([fresh], sel.groups).rows()
    assert rows.token_weights is not None
    replayed = rows.token_weights[G:]
    assert torch.equal(replayed * MASK, weights * MASK)  # the second row stays dropped
    assert torch.equal(rows.token_weights[:G], torch.ones(G, T))  # fresh: no weights given


def test_state_round_trip_keeps_groups_weights_and_gate():
    gate = RecordingGate(tau=0.5)
    replay = GroupReplay(4, "headroom_drift", gate=gate, budget=2)
    weights = torch.full((G, T), 0.25)
    replay.store(1, **tensors(0), token_weights=weights, group_id="a")
    replay.store(1, **tensors(1), group_id="b")
    replay.select(2, shifted({"a": 0.9, "b": 0.1}))
    replay.ingest([])
    tensors_, meta = replay.state()
    restored = GroupReplay(4, "headroom_drift", gate=RecordingGate(tau=1.0), budget=2)
    restored.load_state(tensors_, meta)
    assert [g.group_id for g in restored.buffer] == ["a", "b"]
    assert [g.replay_count for g in restored.buffer] == [g.replay_count for g in replay.buffer]
    assert torch.equal(restored.buffer.groups()[0].token_weights, weights)
    assert restored.buffer.groups()[1].token_weights is None
    assert restored.gate.tau == gate.tau == 0.25 and restored.gate.seen == gate.seen
    assert restored.stored == 2
    # a fixed gate keeps its own tau (a resumed run may change it by config)
    fixed = GroupReplay(4, "headroom_drift", budget=2, tau=0.01)
    fixed.load_state(tensors_, meta)
    assert fixed.gate.tau == 0.01 and math.isfinite(fixed.buffer.groups()[0].headroom)
