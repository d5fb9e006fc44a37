"""The adaptive drift gate serving the replay gate (`replay.gate: adaptive`) in hdr's loop: in
a real short run its tau moves toward the target step by step, logged per step and kept in the
checkpoint's replay state; the fixed default builds the paper's constant gate as before (on
hand-made drifts: tests/headroom_drift/test_lifecycle.py)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TINY_CPU, tiny_overrides

from core.config import load_config
from core.errors import UserError
from headroom_drift.gates import AdaptiveGate, FixedGate, adapt_tau
from trainer.checkpoint import open_checkpoint
from trainer.config import TrainConfig
from trainer.loop import train


def test_the_config_names_the_gate_and_the_default_is_the_fixed_one(tmp_path):
    base = tiny_overrides("http://127.0.0.1:1", tmp_path, tmp_path / "qa", tmp_path / "o")
    default = load_config(TrainConfig, TINY_CPU, base)
    assert default.replay.gate == "fixed"
    assert default.replay.make_gate() == FixedGate(default.replay.tau)
    fixed = default.make_replay()
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
        (["replay.gate=adaptive", "replay.rule=replay_recency"], "has none"),
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
    ckpt = open_checkpoint(tmp_path / "run")
    state = torch.load(ckpt.path / "replay.pt", weights_only=True)["gate"]
    assert "replay_gate" not in ckpt.counters()  # one owner of the gate's state
    assert math.isclose(state["tau"], got[-1]["replay_tau_next"])
    assert torch.isfinite(torch.tensor(state["tau"]))
