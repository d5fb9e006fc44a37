"""The adaptive drift gate serving the replay gate (`replay.gate: adaptive`): through the
lifecycle owner on hand-made drifts its tau settles where the declared share of scanned groups
passes; in a real short run its tau moves toward the target step by step, logged per step and
kept in the checkpoint; the fixed default builds the paper's constant gate as before."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TINY_CPU, tiny_overrides
from test_lifecycle import shifted, tensors

from core.config import load_config
from core.errors import UserError
from trainer.checkpoint import open_checkpoint
from trainer.config import TrainConfig
from trainer.gate import AdaptiveGate, FixedGate, adapt_tau
from trainer.primitive import GroupReplay
from trainer.train import train


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


def test_the_config_names_the_gate_and_the_default_is_the_fixed_one(tmp_path):
    base = tiny_overrides("http://127.0.0.1:1", tmp_path, tmp_path / "qa", tmp_path / "o")
    default = load_config(TrainConfig, TINY_CPU, base)
    assert default.replay.gate == "fixed"
    assert default.replay.make_gate() == FixedGate(default.replay.tau)
    fixed = GroupReplay.from_params(6, default.arm, default.select_params)
    assert isinstance(fixed.gate, FixedGate) and fixed.gate.tau == default.replay.tau
    adaptive = load_config(
        TrainConfig, TINY_CPU,
        [*base, "replay.gate=adaptive", "replay.adaptive_gate.target=0.25",
         "replay.adaptive_gate.rate=0.5"],
    )  # fmt: skip
    gate = adaptive.replay.make_gate()
    assert isinstance(gate, AdaptiveGate)
    assert (gate.tau, gate.target, gate.kind, gate.rate) == (1.0, 0.25, "acceptance", 0.5)
    for bad, says in (
        (["replay.gate=adaptive", "replay.adaptive_gate.target=2"], "is an acceptance rate"),
        (["replay.gate=adaptive", "arm=replay_recency"], "has none"),
        (["replay.gate=adaptive", "replay.tau=0"], "outside the gate's range"),
    ):
        with pytest.raises(UserError, match=says):
            load_config(TrainConfig, TINY_CPU, [*base, *bad])


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_in_a_real_run_tau_moves_toward_the_target_each_step(
    sft_policy, small_qa, retrieval_url, tmp_path
):
    # tau starts below any real drift: nothing passes, so each step that scans raises it by
    # exactly the controller's step; the checkpoint keeps where it got to
    rate = 2.0
    cfg = load_config(
        TrainConfig, TINY_CPU,
        tiny_overrides(retrieval_url, sft_policy, small_qa, tmp_path / "run", "steps=3",
                       "eval.every=0", "checkpoint.save_every=3", "replay.tau=1e-6",
                       "replay.gate=adaptive", "replay.adaptive_gate.target=0.5",
                       f"replay.adaptive_gate.rate={rate}", "grpo.lr=1e-2"),
    )  # fmt: skip
    got = rows(train(cfg))
    assert got[0]["replay_tau"] == 1e-6 and got[0]["scanned_groups"] == 0
    assert got[0]["replay_tau_next"] == 1e-6  # nothing scanned: nothing measured
    scanned = [r for r in got if r["scanned_groups"]]
    assert scanned, "no step scanned the buffer"
    for before, after in itertools.pairwise(got):
        assert after["replay_tau"] == before["replay_tau_next"]  # carried step to step
    for r in scanned:
        share = r["replayed_groups"] / r["scanned_groups"]
        assert r["replay_gate_measured"] == pytest.approx(share)
        want = adapt_tau(r["replay_tau"], share, 0.5, rate, 1e-8, 1e4)
        assert r["replay_tau_next"] == pytest.approx(want)
        if share < 0.5:
            assert r["replay_tau_next"] > r["replay_tau"]  # toward the target
    assert got[-1]["replay_tau_next"] > 1e-6
    state = open_checkpoint(tmp_path / "run").counters()["replay_gate"]
    assert math.isclose(state["tau"], got[-1]["replay_tau_next"])
    assert torch.isfinite(torch.tensor(state["tau"]))
