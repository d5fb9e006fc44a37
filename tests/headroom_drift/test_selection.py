"""Headroom, drift, the FIFO buffer and the replay rules on hand-built groups (no model)."""

import math

import pytest
import torch

from headroom_drift import (
    RULES,
    GroupTensors,
    ReplayBuffer,
    ScanParams,
    StoredGroup,
    headroom,
    make_group,
    policy_drift,
    register_rule,
    replay_rule,
)
from headroom_drift.published import (
    FreshnessParams,
    SwapParams,
    freshness_priority,
    importance_weights,
    zero_variance_swap_score,
)

LN = math.log


def test_headroom_hand_values():
    # row 0: A>0 -> 1-p; row 1: A<0 -> p; row 2: A=0 -> left out; column 0 masked out.
    p = torch.tensor([[0.01, 0.9, 0.6], [0.01, 0.2, 0.5], [0.01, 0.3, 0.3]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    h = headroom(p.log(), mask, torch.tensor([1.5, -0.5, 0.0]))
    assert h.item() == pytest.approx((0.1 + 0.4 + 0.2 + 0.5) / 4, abs=1e-6)


def test_headroom_is_zero_when_every_advantage_is_zero():
    lp = torch.full((2, 3), LN(0.5))
    assert headroom(lp, torch.ones(2, 3), torch.zeros(2)).item() == 0.0


def test_headroom_only_positive_or_only_negative():
    lp = torch.tensor([[LN(0.25), LN(0.75)]])
    mask = torch.ones(1, 2)
    assert headroom(lp, mask, torch.tensor([1.0])).item() == pytest.approx(0.5)  # (.75+.25)/2
    assert headroom(lp, mask, torch.tensor([-1.0])).item() == pytest.approx(0.5)
    lp = torch.tensor([[LN(0.1), LN(0.3)]])
    assert headroom(lp, mask, torch.tensor([1.0])).item() == pytest.approx(0.8)
    assert headroom(lp, mask, torch.tensor([-1.0])).item() == pytest.approx(0.2)


def test_drift_l1_l2_hand_values_over_all_responses():
    gen = torch.zeros(2, 3)
    cur = torch.tensor([[100.0, 0.5, -0.5], [-100.0, 1.0, -2.0]])  # column 0 is masked
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    assert policy_drift(cur, gen, mask).item() == pytest.approx((0.25 + 0.25 + 1 + 4) / 4)
    assert policy_drift(cur, gen, mask, "l1").item() == pytest.approx((0.5 + 0.5 + 1 + 2) / 4)
    with pytest.raises(ValueError):
        policy_drift(cur, gen, mask, "l3")


def test_drift_is_zero_for_identical_logprobs():
    lp = torch.randn(4, 7)
    assert policy_drift(lp, lp.clone(), torch.ones(4, 7)).item() == 0.0


# --- hand-built buffer ------------------------------------------------------------------

MASK = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])


def group(name: str, stored_h: float, step: int, adv=(1.0, -1.0)) -> StoredGroup:
    return StoredGroup(
        group_id=name,
        input_ids=torch.tensor([[1, 2, 3], [1, 4, 5]]),
        attention_mask=torch.ones(2, 3, dtype=torch.long),
        loss_mask=MASK.clone(),
        gen_logprobs=torch.full((2, 3), LN(0.5)) * MASK,
        rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor(adv),
        headroom=stored_h,
        entered_step=step,
    )


class Policy:
    """A hand-set 'current policy': each group's log-probs are its stored ones shifted by a
    per-group offset on policy tokens, so its L2 drift is offset^2 and its L1 drift |offset|."""

    def __init__(self, offsets: dict[str, float]):
        self.offsets = offsets
        self.calls: list[list[str]] = []

    def __call__(self, groups):
        self.calls.append([g.group_id for g in groups])
        return [g.gen_logprobs + self.offsets.get(g.group_id, 0.0) * g.loss_mask for g in groups]

    @property
    def scored(self):
        return [name for call in self.calls for name in call]


def buffer_of(*groups, capacity=10) -> ReplayBuffer:
    buf = ReplayBuffer(capacity)
    for g in groups:
        buf.add(g)
    return buf


def select(arm, buf, step, policy, **params):
    return replay_rule(arm)(buf, step, ScanParams(**params), policy)


def test_headroom_drift_ranks_by_stored_headroom():
    buf = buffer_of(group("a", 0.2, 0), group("b", 0.9, 1), group("c", 0.5, 2), group("d", 0.7, 3))
    policy = Policy({})
    sel = select("headroom_drift", buf, 4, policy, budget=2, tau=0.1)
    assert [g.group_id for g in sel.groups] == ["b", "d"]
    assert sel.scanned == 2 and policy.scored == ["b", "d"]
    assert sel.acceptance_rate == 1.0
    assert sel.headroom_stored == [0.9, 0.7]


def test_gate_rejects_drifted_groups_and_refreshes_their_headroom():
    buf = buffer_of(group("a", 0.2, 0), group("b", 0.9, 1), group("c", 0.5, 2), group("d", 0.7, 3))
    policy = Policy({"b": -1.0})  # L2 drift 1.0 > tau; others drift 0
    sel = select("headroom_drift", buf, 4, policy, budget=2, tau=0.1)
    assert [g.group_id for g in sel.groups] == ["d", "c"]
    assert sel.scanned == 3
    assert sel.acceptance_rate == pytest.approx(2 / 3)
    assert sel.drift_scanned == pytest.approx([1.0, 0.0, 0.0])
    assert sel.drift_admitted == pytest.approx([0.0, 0.0])
    # every scanned group's stored headroom is refreshed from the same log-probs:
    # p = 0.5 -> h = 0.5 for both signs; b's shifted p = 0.5/e -> (1 - p + p) / 2 = 0.5 too
    b = next(g for g in buf if g.group_id == "b")
    assert b.headroom == pytest.approx(0.5)
    assert sel.headroom_refreshed == pytest.approx([0.5, 0.5])
    a = next(g for g in buf if g.group_id == "a")
    assert a.headroom == 0.2  # never scanned: untouched


def test_refreshed_headroom_matches_formula_for_one_sided_group():
    g = group("x", 0.99, 0, adv=(1.0, 0.0))
    buf = buffer_of(g)
    select("headroom_drift", buf, 1, Policy({"x": LN(0.2 / 0.5)}), budget=1, tau=10.0)
    assert g.headroom == pytest.approx(0.8)  # row 0 only, p = 0.2 -> 1 - p


def test_budget_stop_and_exhaustion():
    groups = [group(f"g{i}", 1.0 - i / 10, i) for i in range(6)]
    policy = Policy({"g0": 1.0, "g1": 1.0})
    sel = select("headroom_drift", buffer_of(*groups), 6, policy, budget=3, tau=0.5, chunk=8)
    assert [g.group_id for g in sel.groups] == ["g2", "g3", "g4"]
    assert policy.scored == ["g0", "g1", "g2", "g3", "g4"]  # g5 never scored
    # each chunk holds no more candidates than there are open slots
    assert policy.calls == [["g0", "g1", "g2"], ["g3", "g4"]]
    # too few admissible groups: the scan runs out and returns what it found
    policy = Policy({f"g{i}": 1.0 for i in range(5)})
    sel = select("headroom_drift", buffer_of(*groups), 6, policy, budget=3, tau=0.5)
    assert [g.group_id for g in sel.groups] == ["g5"] and sel.scanned == 6


def test_chunk_caps_scoring_batch():
    groups = [group(f"g{i}", 0.5, i) for i in range(5)]
    policy = Policy({})
    select("headroom_drift", buffer_of(*groups), 5, policy, budget=5, tau=1.0, chunk=2)
    assert [len(c) for c in policy.calls] == [2, 2, 1]


def test_fifo_evicts_oldest_whatever_its_priority():
    buf = ReplayBuffer(3)
    assert buf.add(group("old", 0.99, 0)) == []
    buf.add(group("b", 0.1, 1))
    buf.add(group("c", 0.1, 2))
    evicted = buf.add(group("d", 0.1, 3))
    assert [g.group_id for g in evicted] == ["old"]
    assert [g.group_id for g in buf] == ["b", "c", "d"]


def test_no_same_step_replay():
    buf = buffer_of(group("past", 0.1, 2), group("now", 0.9, 3))
    for arm in ("headroom_drift", "headroom_only", "drift_only", "replay_recency"):
        sel = select(arm, buf, 3, Policy({}), budget=2, tau=1.0)
        assert [g.group_id for g in sel.groups] == ["past"], arm


def test_recency_takes_newest_without_scoring():
    buf = buffer_of(*(group(f"g{i}", 0.9 - i / 10, i) for i in range(5)))
    policy = Policy({"g4": 5.0})
    sel = select("replay_recency", buf, 5, policy, budget=2, tau=0.0)
    assert [g.group_id for g in sel.groups] == ["g4", "g3"]
    assert policy.calls == [] and sel.scanned == 0


def test_drift_only_is_recency_order_gated():
    buf = buffer_of(*(group(f"g{i}", 0.9 - i / 10, i) for i in range(5)))
    sel = select("drift_only", buf, 5, Policy({"g4": 1.0}), budget=2, tau=0.5)
    assert [g.group_id for g in sel.groups] == ["g3", "g2"]


def test_headroom_only_has_no_gate():
    buf = buffer_of(group("a", 0.2, 0), group("b", 0.9, 1))
    sel = select("headroom_only", buf, 2, Policy({"b": 3.0}), budget=1, tau=0.0)
    assert [g.group_id for g in sel.groups] == ["b"]
    assert sel.drift_admitted == pytest.approx([9.0])


def test_l1_gate_differs_from_l2():
    buf = buffer_of(group("a", 0.5, 0))
    policy = Policy({"a": 0.5})  # L2 0.25, L1 0.5
    assert len(select("headroom_drift", buf, 1, policy, budget=1, tau=0.3).groups) == 1
    assert len(select("headroom_drift_l1", buf, 1, policy, budget=1, tau=0.3).groups) == 0


def test_on_policy_replays_nothing():
    buf = buffer_of(group("a", 0.5, 0))
    assert select("on_policy", buf, 1, Policy({}), budget=4, tau=1.0).groups == []


def test_registry_names_and_unknown_arm():
    assert sorted(RULES) == sorted(
        [
            "on_policy",
            "replay_recency",
            "headroom_only",
            "drift_only",
            "headroom_drift",
            "headroom_drift_l1",
            "replay_freshness_per",
            "replay_zero_variance_swap",
        ]
    )
    with pytest.raises(
        ValueError, match=r"unknown replay rule 'headroom-drift'; valid: .*headroom_drift"
    ):
        replay_rule("headroom-drift")
    with pytest.raises(ValueError, match="already registered"):
        register_rule("headroom_drift", replay_rule("on_policy"))


def test_ingest_skips_zero_advantage_groups_unless_asked():
    buf = ReplayBuffer(4)
    zero = group("zero", 0.0, 0, adv=(0.0, 0.0))
    buf.ingest([zero, group("live", 0.5, 0)])
    assert [g.group_id for g in buf] == ["live"]
    buf.ingest([zero], store_zero_advantage=True)
    assert [g.group_id for g in buf] == ["live", "zero"]


def test_make_group_stores_headroom_from_generation_logprobs():
    tensors = GroupTensors(
        input_ids=torch.tensor([[1, 2, 3]]),
        attention_mask=torch.ones(1, 3, dtype=torch.long),
        loss_mask=torch.tensor([[0, 1, 1]]),
        gen_logprobs=torch.tensor([[0.0, LN(0.25), LN(0.75)]]),
        rewards=torch.tensor([1.0]),
        advantages=torch.tensor([-1.0]),
    )
    g = make_group("m", tensors, step=7)
    assert g.headroom == pytest.approx(0.5) and g.initial_headroom == g.headroom
    assert g.entered_step == 7 and g.replay_count == 0


def test_stored_group_state_roundtrip():
    buf = buffer_of(group("a", 0.3, 0), group("b", 0.4, 1), capacity=5)
    buf.groups()[0].replay_count = 2
    back = ReplayBuffer(5, [StoredGroup.from_state_dict(g.state_dict()) for g in buf])
    assert [(g.group_id, g.headroom, g.replay_count) for g in back] == [
        ("a", 0.3, 2),
        ("b", 0.4, 0),
    ]
    assert torch.equal(back.groups()[1].gen_logprobs, buf.groups()[1].gen_logprobs)


# --- the published rules: freshness-aware PER and the zero-variance swap ----------------------


def rewarded(name: str, rewards, step: int) -> StoredGroup:
    g = group(name, 0.5, step)
    g.rewards = torch.tensor(rewards)
    return g


def test_freshness_priority_and_importance_weights_hand_values():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0], [-1.0, 0.0]])
    age = torch.tensor([0, 10, 10])
    got = freshness_priority(rewards, age, tau_age=10.0)
    assert got.tolist() == pytest.approx([0.5, math.exp(-1), 0.5 * math.exp(-1)])
    probs = torch.tensor([0.5, 0.25, 0.25])
    # (n P)^-beta with n=3, beta=1: 1/1.5, 1/0.75 -> normalised by the max (1/0.75)
    w = importance_weights(probs, torch.tensor([0, 1]), beta=1.0)
    assert w.tolist() == pytest.approx([0.5, 1.0])


def test_freshness_per_samples_by_priority_and_weights_without_rescoring():
    buf = buffer_of(
        rewarded("old", [1.0, 1.0], 0),
        rewarded("zero", [0.0, 0.0], 5),
        rewarded("new", [1.0, 0.0], 5),
    )
    params = FreshnessParams(budget=2, seed=3, total_steps=10, tau_age=2.0)

    def no_scoring(groups):
        raise AssertionError("freshness PER must not re-score")

    sel = replay_rule("replay_freshness_per")(buf, 6, params, no_scoring)
    # a group of zero rewards has priority 0 and is never drawn: the other two are
    assert sorted(g.group_id for g in sel.groups) == ["new", "old"]
    assert sel.scanned == 0 and len(sel.weights) == 2 and max(sel.weights) == 1.0
    again = replay_rule("replay_freshness_per")(buf, 6, params, no_scoring)
    assert [g.group_id for g in again.groups] == [g.group_id for g in sel.groups]  # seeded


def test_zero_variance_swap_replaces_only_flat_fresh_groups():
    stored = buffer_of(rewarded("a", [1.0, 0.0], 0), rewarded("b", [0.0, 0.0], 0))
    stored.groups()[1].advantages = torch.zeros(2)
    fresh = [
        group("f0", 0.5, 1),
        group("f1", 0.0, 1, adv=(0.0, 0.0)),
        group("f2", 0.0, 1, adv=(0.0, 0.0)),
    ]
    score = zero_variance_swap_score(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.7, -0.7]]))
    assert score.item() == pytest.approx(1.4 * math.sqrt(0.5))
    sel = replay_rule("replay_zero_variance_swap")(
        stored, 1, SwapParams(), lambda gs: [], fresh=fresh
    )
    # two flat fresh groups, but only one stored group has a positive score
    assert [g.group_id for g in sel.groups] == ["a"] and sel.swap_out == [1]
    none_flat = replay_rule("replay_zero_variance_swap")(
        stored, 1, SwapParams(seed=4), lambda gs: [], fresh=fresh[:1]
    )
    assert none_flat.groups == [] and none_flat.swap_out == []


def test_zero_variance_swap_draws_from_the_shared_fifo_not_a_top_k_heap():
    """The stated departure from TRL's replay-buffer GRPO: TRL keeps a heap of the k groups
    with the best swap score, hdr's swap rule draws from the FIFO buffer every arm shares, so
    a high-score group that aged out is gone even when it outscores all that remain."""
    buf = ReplayBuffer(capacity=2)
    best = rewarded("best", [1.0, 0.0], 0)
    best.advantages = torch.tensor([5.0, -5.0])  # the highest sum|A| x std(r) by far
    for g in (best, rewarded("b", [1.0, 0.0], 1), rewarded("c", [1.0, 0.0], 2)):
        buf.add(g)
    assert [g.group_id for g in buf] == ["b", "c"]  # FIFO: "best" left first
    flat = [group("f", 0.0, 3, adv=(0.0, 0.0))]
    for seed in range(20):
        sel = replay_rule("replay_zero_variance_swap")(
            buf, 3, SwapParams(seed=seed), lambda gs: [], fresh=flat
        )
        assert [g.group_id for g in sel.groups] in (["b"], ["c"])
