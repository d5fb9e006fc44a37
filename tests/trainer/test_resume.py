"""Resume: `hdr train` killed with SIGKILL after a checkpoint continues exactly, and a
corrupt or half-written checkpoint is refused with one clear line."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import TINY_CPU, replay_state, same_state, tiny_overrides
from safetensors.torch import load_file

from core.errors import UserError
from trainer.checkpoint import list_checkpoints, open_checkpoint
from trainer.telemetry import COUNT_KEYS

COMPARED = [
    "reward_mean",
    "em_mean",
    "entropy",
    "loss",
    "fresh_tokens",
    "replay_tokens",
    "replayed_groups",
    "scanned_groups",
    "drift_scanned_q",
    "drift_admitted_q",
    "headroom_scanned_q",
    "headroom_stored",
    "headroom_refreshed",
    "replay_ages",
    "replay_counts",
    "buffer_size",
    "env_calls",
    "env_calls_total",
    *COUNT_KEYS,  # the cost ledger's counts: a resumed run spends what the original did
]


def hdr(*args: str) -> list[str]:
    return [sys.executable, "-m", "hdr.cli", *args]


def env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def rows(run_dir, name="metrics"):
    return [json.loads(x) for x in (run_dir / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(sft_policy, small_qa, retrieval_url, tmp_path_factory):
    """An uninterrupted run, and one SIGKILLed after a checkpoint then resumed."""
    root = tmp_path_factory.mktemp("resume")
    whole, cut = root / "whole", root / "cut"

    def overrides(out):
        return tiny_overrides(retrieval_url, sft_policy, small_qa, out)

    subprocess.run(
        hdr("train", "--config", str(TINY_CPU), *overrides(whole)), env=env(), check=True
    )
    proc = subprocess.Popen(hdr("train", "--config", str(TINY_CPU), *overrides(cut)), env=env())
    deadline = time.monotonic() + 300
    while not list_checkpoints(cut / "checkpoints"):
        assert proc.poll() is None, "the run ended before its first checkpoint was seen"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    killed_at = open_checkpoint(cut).step
    assert killed_at < 5, "the run finished before it could be killed"
    subprocess.run(hdr("train", "--resume", str(cut)), env=env(), check=True)
    return whole, cut, killed_at


def test_resumed_run_matches_uninterrupted(runs):
    whole, cut, k = runs
    a, b = rows(whole), rows(cut)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]  # logged after k once, not twice
    for ra, rb in zip(a[k:], b[k:], strict=True):
        assert {key: ra[key] for key in COMPARED} == {key: rb[key] for key in COMPARED}
    assert any(r["replayed_groups"] for r in a[k:]) or any(r["loss"] for r in a[k:])
    ev_a = [
        {k2: e[k2] for k2 in ("step", "mean_at_k", "best_at_k", "greedy_em")}
        for e in rows(whole, "eval")
    ]
    ev_b = [
        {k2: e[k2] for k2 in ("step", "mean_at_k", "best_at_k", "greedy_em")}
        for e in rows(cut, "eval")
    ]
    assert ev_a == ev_b


def test_resumed_buffer_and_weights_match(runs):
    whole, cut, _ = runs
    ca, cb = whole / "checkpoints" / "step-000005", cut / "checkpoints" / "step-000005"
    assert same_state(replay_state(ca), replay_state(cb))
    assert len(replay_state(ca)["groups"]) > 0
    for name in ("model/model.safetensors",):
        ta, tb = load_file(ca / name), load_file(cb / name)
        assert ta.keys() == tb.keys()
        assert all((ta[key] == tb[key]).all() for key in ta), name
    assert rows(whole, "groups") == rows(cut, "groups")


def test_half_written_checkpoint_is_refused(runs, tmp_path):
    whole, _, _ = runs
    ckpt = tmp_path / "checkpoints" / "step-000005"
    shutil.copytree(whole / "checkpoints" / "step-000005", ckpt)
    (ckpt / "manifest.json").unlink()  # as if killed before the manifest was written
    with pytest.raises(UserError, match="incomplete"):
        open_checkpoint(ckpt)


def test_corrupt_checkpoint_is_refused_with_one_line(runs, tmp_path):
    whole, _, _ = runs
    ckpt = tmp_path / "checkpoints" / "step-000005"
    shutil.copytree(whole / "checkpoints" / "step-000005", ckpt)
    weights = ckpt / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    with pytest.raises(UserError, match="corrupt"):
        open_checkpoint(ckpt)
    proc = subprocess.run(
        hdr("train", "--resume", str(ckpt)), env=env(), capture_output=True, text=True
    )
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert err[-1].startswith("hdr: error: checkpoint") and "corrupt" in err[-1]
    assert "Traceback" not in proc.stderr


def test_run_dir_without_checkpoints_is_refused(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ".tmp-step-000003-123").mkdir()  # never renamed into place
    with pytest.raises(UserError, match="no finished checkpoint"):
        open_checkpoint(tmp_path)
