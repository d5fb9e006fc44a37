"""A run checkpointed by an earlier hdr resumes with today's code to the same weights.

tests/fixtures/old-checkpoint holds the step-2 checkpoint of a 3-step run written by main at
fb200a9, in the format of that time (the replay buffer in `buffer.safetensors` + `buffer.json`,
the adaptive replay gate's tau among `state.json`'s counters), with the run's own files and
the weights its step 3 ended with (its make.py says how it was made). Resumed here, step 3
must replay the same stored groups, log the same step and end with those weights: bit for bit
on the machine that wrote them, within float rounding on another CPU (the resumed step starts
from the same files; only the kernels' rounding may differ).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from old_checkpoint import OVERRIDES
from safetensors.torch import load_file

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "old-checkpoint"
COMPARED = ("reward_mean", "replayed_group_ids", "fresh_group_ids", "scanned_groups",
            "replay_ages", "replay_counts", "buffer_size", "headroom_stored")  # fmt: skip


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def resumed(small_qa, retrieval_url, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("old-checkpoint") / "run"
    shutil.copytree(FIXTURE / "run", run)
    subprocess.run(
        [sys.executable, "-m", "hdr.cli", "train", "--resume", str(run),
         f"retrieval.urls=[{retrieval_url}]", f"data.train={small_qa}", f"data.eval={small_qa}"],
        check=True,
    )  # fmt: skip
    return run


def test_the_fixture_is_the_old_format_with_a_filled_buffer_and_a_moved_gate():
    step = FIXTURE / "run" / "checkpoints" / "step-000002"
    assert (step / "buffer.safetensors").is_file() and (step / "buffer.json").is_file()
    assert len(json.loads((step / "buffer.json").read_text())["groups"]) == 4
    gate = json.loads((step / "state.json").read_text())["replay_gate"]
    assert gate["tau"] != 1.0  # replay.tau=1.0 at the start: the gate had moved
    assert "steps=3" in OVERRIDES


def test_the_resumed_step_is_the_original_one(resumed):
    original = rows(FIXTURE / "run" / "metrics.jsonl")[-1]
    again = rows(resumed / "metrics.jsonl")[-1]
    assert original["step"] == again["step"] == 3
    assert original["replayed_groups"] == again["replayed_groups"] == 2
    for key in COMPARED:
        assert again[key] == original[key], key
    assert again["loss"] == pytest.approx(original["loss"], rel=1e-4, abs=1e-6)


def test_the_resumed_run_ends_with_the_original_weights(resumed):
    expected = load_file(FIXTURE / "final-model.safetensors")
    got = load_file(resumed / "final" / "model.safetensors")
    start = load_file(FIXTURE / "run" / "checkpoints" / "step-000002" / "model" /
                      "model.safetensors")  # fmt: skip
    assert expected.keys() == got.keys()
    moved = max(float((expected[k] - start[k]).abs().max()) for k in expected)
    assert moved > 1e-4  # step 3 changed the weights, so the comparison means something
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)
