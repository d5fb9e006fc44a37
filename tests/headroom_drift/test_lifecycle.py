"""The replay lifecycle's one owner, `headroom_drift.GroupReplay`: store, select by a rule,
gate by measured drift through a gate object, ingest after the update, weights that travel with
a stored group, and its state for checkpoints (hand-built groups, no model)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from headroom_drift import (
    FixedGate,
    Gate,
    GroupReplay,
    GroupTensors,
    LateGroups,
    assemble_batch,
    make_group,
)
from headroom_drift.gates import AdaptiveGate

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


def test_state_round_trip_keeps_groups_weights_and_gate(tmp_path):
    gate = RecordingGate(tau=0.5)
    replay = GroupReplay(4, "headroom_drift", gate=gate, budget=2)
    weights = torch.full((G, T), 0.25)
    replay.store(1, **tensors(0), token_weights=weights, group_id="a")
    replay.store(1, **tensors(1), group_id="b")
    replay.select(2, shifted({"a": 0.9, "b": 0.1}))
    replay.ingest([])
    path = replay.save(tmp_path / "replay.pt")
    restored = GroupReplay(4, "headroom_drift", gate=RecordingGate(tau=1.0), budget=2)
    restored.load(path)
    assert [g.group_id for g in restored.buffer] == ["a", "b"]
    assert [g.replay_count for g in restored.buffer] == [g.replay_count for g in replay.buffer]
    assert torch.equal(restored.buffer.groups()[0].token_weights, weights)
    assert restored.buffer.groups()[1].token_weights is None
    assert restored.gate.tau == gate.tau == 0.25 and restored.gate.seen == gate.seen
    assert restored.stored == 2
    # a fixed gate keeps its own tau (a resumed run may change it by config)
    fixed = GroupReplay(4, "headroom_drift", budget=2, tau=0.01)
    fixed.load_state_dict(torch.load(path, weights_only=True))
    assert fixed.gate.tau == 0.01 and math.isfinite(fixed.buffer.groups()[0].headroom)


def test_the_staleness_gate_is_part_of_the_state(tmp_path):
    late = LateGroups("adaptive_drift_gate", AdaptiveGate(tau=0.1, target=0.5), max_lag=1)
    replay = GroupReplay(4, "headroom_drift", budget=2, tau=0.5, late=late)
    fresh = [make_group(f"s3/{k}", group_tensors(k), 3) for k in range(2)]
    far = [g.gen_logprobs + 2.0 * g.loss_mask for g in fresh]  # the sampler was far off
    decision = replay.admit_late(fresh, far, [1, 1])
    assert decision.admission.admitted.tolist() == [False, False]
    assert len(decision.to_buffer) == 2 and not decision.trained
    assert late.gate.tau > 0.1  # nothing admitted against a target of 0.5: tau rises
    replay.ingest(decision.to_buffer)
    restored = GroupReplay(
        4, "headroom_drift", budget=2, tau=0.5,
        late=LateGroups("adaptive_drift_gate", AdaptiveGate(tau=0.1, target=0.5), max_lag=1),
    )  # fmt: skip
    restored.load(replay.save(tmp_path / "replay.pt"))
    assert restored.late.gate.tau == late.gate.tau
    assert [g.group_id for g in restored.buffer] == ["s3/0", "s3/1"]


def test_a_state_loads_at_the_loading_buffers_capacity():
    # the capacity is the loader's (a resumed run's config): a smaller one keeps the newest
    # groups and returns the others, oldest first; a larger one keeps all
    replay = GroupReplay(4, "headroom_drift", budget=2, tau=0.5)
    for k in range(4):
        replay.store(k + 1, **tensors(k), group_id=f"g{k}")
    state = replay.state_dict()
    smaller, larger = (GroupReplay(c, "headroom_drift", budget=2, tau=0.5) for c in (1, 8))
    assert [g.group_id for g in smaller.load_state_dict(state)] == ["g0", "g1", "g2"]
    assert [g.group_id for g in smaller.buffer] == ["g3"] and smaller.buffer.capacity == 1
    assert larger.load_state_dict(state) == [] and len(larger) == 4
    assert larger.buffer.capacity == 8


def test_a_state_is_taken_between_steps_and_of_its_own_format():
    replay = GroupReplay(4, "headroom_drift", budget=2, tau=0.5)
    replay.store(1, **tensors(0), group_id="a")
    replay.select(2, shifted({}))
    with pytest.raises(ValueError, match="between steps"):
        replay.state_dict()
    replay.ingest([])
    with pytest.raises(ValueError, match=r"not a headroom_drift\.GroupReplay state"):
        replay.load_state_dict({"capacity": 4, "groups": []})
    newer = {**replay.state_dict(), "version": 99}
    with pytest.raises(ValueError, match="newer"):
        replay.load_state_dict(newer)


def test_through_the_lifecycle_tau_settles_where_half_the_scanned_groups_pass():
    # four stored groups with L2 drifts 0.01, 0.04, 0.09, 0.16; target: half of them admitted
    gate = AdaptiveGate(tau=1e-3, target=0.5, rate=0.2)
    replay = GroupReplay(8, "headroom_drift", gate=gate, budget=4, chunk=8)
    offsets = {f"g{k}": 0.1 * (k + 1) for k in range(4)}
    for k, name in enumerate(offsets):
        replay.store(1, **tensors(k), group_id=name)
    taus, shares = [], []
    for step in range(2, 62):
        sel = replay.select(step, shifted(offsets))
        replay.ingest([])
        assert sel.scanned == 4  # the budget never stops the scan early: the share is fair
        shares.append(sel.acceptance_rate)
        taus.append(gate.tau)
    assert shares[0] == 0.0 and taus[0] > 1e-3  # nothing passed: tau rose
    assert all(b > a for a, b in itertools.pairwise(taus[:10]))  # climbing
    late = shares[-20:]
    assert 0.25 <= sum(late) / len(late) <= 0.75  # held around the target
    assert 0.03 <= taus[-1] <= 0.12  # between the 2nd and 3rd drift, up to one step past


def test_callers_read_views_and_late_groups_come_back_new():
    """What callers read (`tau`, `gate_measured`, `groups()`) changes nothing, and the
    staleness rule leaves the groups it is given as they were: the late ones it returns are
    new groups carrying the sampler's log-probs."""
    late = LateGroups("version_bound", max_lag=1)
    replay = GroupReplay(
        4, "headroom_drift", gate=AdaptiveGate(tau=0.3, target=0.5), late=late, budget=1
    )
    assert replay.tau == 0.3 and math.isnan(replay.gate_measured)
    replay.store(1, **tensors(0), group_id="a")
    replay.select(2, shifted({"a": 0.1}))
    replay.ingest([])
    assert replay.gate_measured == replay.gate.last_measured and not math.isnan(replay.tau)
    view = replay.groups()
    assert [g.group_id for g in view] == ["a"] and isinstance(view, tuple)
    fresh = [make_group(f"s3/{k}", group_tensors(k), 3) for k in range(2)]
    before = [g.gen_logprobs.clone() for g in fresh]
    sampled = [g.gen_logprobs - 0.5 * g.loss_mask for g in fresh]
    decision = replay.admit_late(fresh, sampled, [0, 1])
    assert all(torch.equal(g.gen_logprobs, b) for g, b in zip(fresh, before, strict=True))
    on_time, was_late = decision.trained
    assert on_time is fresh[0] and was_late is not fresh[1]
    assert torch.equal(was_late.gen_logprobs, sampled[1] * was_late.loss_mask)


def test_every_process_takes_the_selection_the_broadcast_hands_it():
    """`decided_by`: a process whose own scan admitted another group takes the main
    process's selection, by id from its own buffer, with what that scan saw; its gate learns
    from the agreed selection (the two processes are two lifecycles here; `broadcast` hands
    over what the main one made)."""
    main, other = (GroupReplay(4, "headroom_drift", budget=1, tau=0.5) for _ in range(2))
    for replay in (main, other):
        replay.store(1, **tensors(0), group_id="a")
        replay.store(1, **tensors(1), group_id="b")
    made = {}
    main.select(
        2, shifted({"a": 0.1, "b": 0.9}), agree=main.decided_by(lambda v: made.setdefault("v", v))
    )
    agreed = other.select(
        2, shifted({"a": 0.9, "b": 0.1}), agree=other.decided_by(lambda v: made["v"])
    )
    assert made["v"][0] == [g.group_id for g in main.pending.groups] == ["a"]  # its own: b
    assert [g.group_id for g in agreed.groups] == made["v"][0]
    assert agreed.groups[0] is next(g for g in other.groups() if g.group_id == made["v"][0][0])
    assert agreed.drift_scanned == main.pending.drift_scanned
    strange = GroupReplay(4, "headroom_drift", budget=1, tau=0.5)
    with pytest.raises(RuntimeError, match="lacks groups"):
        strange.select(2, shifted({}), agree=strange.decided_by(lambda v: made["v"]))
