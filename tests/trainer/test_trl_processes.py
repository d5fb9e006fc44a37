"""`hdr trl-train` in two CPU processes: TRL's GRPOTrainer under torchrun (accelerate's
MULTI_CPU, gloo), with hdr's rollout and Headroom-Drift Replay.

`accelerate launch --cpu` starts a single process (several CPU processes need its mpirun
path); accelerate itself runs multi-process on the CPU when torchrun starts it, which is
what this test does (about 10 s beside the session's SFT policy). Each process keeps the same
buffer and must make the same selection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("trl")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the default run has the same claim under ZeRO-3 (test_trl_zero3.py's whole run)
def test_two_processes_train_and_replay_the_same_groups(
    sft_policy, small_qa, retrieval_url, tmp_path
):
    out = tmp_path / "trl"
    config = {
        "model": str(sft_policy),
        "data": {"train": str(small_qa)},
        "max_questions": 16,
        "retrieval": {"urls": [retrieval_url], "topk": 2, "retriever": "bm25"},
        "rollout": {
            "prompt": {
                "template": "Question: {question}\n", "chat_template": False,
                "response_prefix": "<search>", "observation_suffix": "<answer>",
            },
            "max_turns": 1, "max_tokens_per_turn": 16, "max_obs_tokens": 64, "doc_words": 6,
            "reward": "f1", "format_weight": 0.5, "on_failure": "keep",
        },
        "replay": {"replay": {"rule": "headroom_drift", "budget": 2, "capacity": 8, "tau": 10.0}},
        "trl": {
            "output_dir": str(out), "seed": 0, "max_steps": 4, "learning_rate": 1.0e-3,
            "use_cpu": True, "bf16": False, "gradient_checkpointing": False,
            "per_device_train_batch_size": 8, "num_generations": 4,
        },
    }  # fmt: skip
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["TRL_EXPERIMENTAL_SILENCE"] = "1"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "hdr", "trl-train", "--config", str(path),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = [
        [json.loads(line) for line in (out / f"replay-{rank}.jsonl").read_text().splitlines()]
        for rank in (0, 1)
    ]
    assert [r["step"] for r in logs[0]] == [1, 2, 3, 4]
    for mine, theirs in zip(*logs, strict=True):
        # every process holds every process's fresh groups and makes the same selection
        assert mine["fresh"] == theirs["fresh"]
        assert {name.split("/")[1] for name in mine["fresh"]} == {"0", "1"}
        assert mine["replayed"] == theirs["replayed"]
        assert mine["drift_scanned"] == pytest.approx(theirs["drift_scanned"], abs=1e-6)
        assert mine["num_items"] == theirs["num_items"]  # one global token-mean denominator
    assert sum(len(r["replayed"]) for r in logs[0]) >= 1
    # each process trains on its share of the replayed groups (as many rows on each)
    for step in logs[0]:
        rows = [log[step["step"] - 1]["trained_rows"] for log in logs]
        assert sum(rows) == 2 * 8 + 4 * len(step["replayed"])
        assert rows[0] == rows[1]
    assert (out / "model.safetensors").exists()


def test_trl_train_answers_a_bad_setting_in_one_line(tmp_path):
    """A key TRL's GRPOConfig does not know: one line, exit 2, before anything is loaded or
    connected."""
    config = REPO / "configs" / "trl" / "tiny-cpu.yaml"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    hdr = [sys.executable, "-m", "hdr", "trl-train", "--config", str(config)]
    done = subprocess.run(
        [*hdr, "trl.nonsense=1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "hdr: error: trl: GRPOConfig.__init__() got an unexpected keyword argument 'nonsense'"
    )
    assert "Traceback" not in done.stderr
