"""One replay state format for hdr's loop and its TRL trainer, and the formats before it.

Both write `GroupReplay.save` (`replay.pt`) and read it back through the same code; a
checkpoint written before that format (hdr's loop: `buffer.safetensors` + `buffer.json` and
the gates among `state.json`'s counters; TRL: `hdr_replay.safetensors` + `hdr_replay.json`) is
read into the same state. tests/fixtures/old-checkpoint holds one of each, for the same buffer
(its make.py), written by main at fb200a9; the TRL trainer saving and resuming the new format
is test_trl_defects.py's `test_resume_from_a_trl_checkpoint_keeps_the_buffer`, an old hdr run
resuming is test_old_checkpoint.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import same_state
from safetensors.torch import load_file

from headroom_drift import AdaptiveGate, GroupReplay
from headroom_drift.lifecycle import STATE_FORMAT
from trainer.checkpoint import REPLAY_STATE, Checkpoint, legacy_replay_state

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "old-checkpoint"
OLD_STEP = FIXTURE / "run" / "checkpoints" / "step-000002"
OLD_TRL = FIXTURE / "trl-checkpoint"


def replay() -> GroupReplay:
    """A lifecycle as the fixture's run configured it (replay.gate adaptive, target 0.5)."""
    return GroupReplay(6, "headroom_drift", gate=AdaptiveGate(tau=1.0, target=0.5), budget=2)


def test_both_old_formats_read_into_one_state():
    from_hdr, from_trl = replay(), replay()
    Checkpoint(OLD_STEP, 2).restore_replay(from_hdr)
    meta = json.loads((OLD_TRL / "hdr_replay.json").read_text())
    from_trl.load_state_dict(
        legacy_replay_state(load_file(OLD_TRL / "hdr_replay.safetensors"), meta)
    )
    assert len(from_hdr) == 4 and [g.group_id for g in from_hdr.buffer] == [
        g.group_id for g in from_trl.buffer
    ]
    gate = json.loads((OLD_STEP / "state.json").read_text())["replay_gate"]
    assert from_hdr.gate.tau == from_trl.gate.tau == gate["tau"] != 1.0  # the moved tau
    a, b = from_hdr.state_dict(), from_trl.state_dict()
    a["stored"] = b["stored"] = 0  # what `store` named groups by: hdr's loop never used it
    assert same_state(a, b)


def test_the_new_format_round_trips_through_the_checkpoint_reader(tmp_path):
    old = replay()
    Checkpoint(OLD_STEP, 2).restore_replay(old)
    (tmp_path / "step").mkdir()
    old.save(tmp_path / "step" / REPLAY_STATE)
    saved = torch.load(tmp_path / "step" / REPLAY_STATE, weights_only=True)
    assert saved["format"] == STATE_FORMAT and len(saved["groups"]) == 4
    again = replay()
    Checkpoint(tmp_path / "step", 2).restore_replay(again)
    assert same_state(again.state_dict(), old.state_dict())
