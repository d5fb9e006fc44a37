"""Weights & Biases beside metrics.jsonl (`log.wandb`): a real run in W&B's offline mode
writes an offline run folder under the run directory, whose history holds every step's
record and the held-out evaluation under the names TensorBoard shows (the run's `.wandb` file
read back record by record: no W&B server, no mock)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY_CPU, tiny_overrides

from core.config import load_config
from trainer.config import TrainConfig
from trainer.loop import train

wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

BLOCK, HEADER = 32768, 7  # the LevelDB log layout of a `.wandb` file: blocks, record headers
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path):
    """The protobuf records of a `.wandb` file, reassembled from its LevelDB log chunks."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = HEADER, b""  # the file's own 7-byte header, then the chunks
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + HEADER : pos + HEADER + length], pos + HEADER + length
        if kind in (FULL, FIRST):
            pending = chunk
        elif kind in (MIDDLE, LAST):
            pending += chunk
        if kind in (FULL, LAST):
            record = wandb_pb.Record()
            record.ParseFromString(pending)
            yield record


def wandb_history(run_dir: Path) -> dict[int, dict]:
    """Step -> what W&B's history holds for it (JSON values, nested keys joined by `/`)."""
    (found,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    rows: dict[int, dict] = {}
    for record in wandb_records(found):
        if record.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                   for i in record.history.item}  # fmt: skip
            rows.setdefault(int(row["_step"]), {}).update(row)
    return rows


def test_an_offline_wandb_run_holds_every_steps_record(
    tiny_policy, small_qa, retrieval_url, tmp_path
):
    cfg = load_config(
        TrainConfig,
        TINY_CPU,
        tiny_overrides(
            retrieval_url, tiny_policy, small_qa, tmp_path / "run", "steps=2",
            "grpo.batch_prompts=2", "grpo.group_size=2", "generation.backend=scripted",
            "rollout.reward=exact_match", "rollout.format_weight=0", "eval.every=2",
            "eval.greedy=false", "checkpoint.save_every=0", "log.tensorboard=false",
            "log.wandb.mode=offline", "log.wandb.project=hdr-test",
            "replay.store_zero_advantage=true", "replay.tau=1e9",  # step 2 replays step 1's
        ),
    )  # fmt: skip
    run_dir = train(cfg)
    import wandb

    wandb.teardown()  # what the end of `hdr train`'s process does: W&B's writer has finished
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    held_out = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    history = wandb_history(run_dir)
    assert sorted(history) == [0, 1, 2]  # the held-out evaluation at step 0, then the steps
    for row in metrics:
        logged = history[row["step"]]
        for key in ("reward_mean", "loss", "lr", "buffer_size", "cost_update_tf_tokens",
                    "cost_generated_tokens", "cost_cpu_update_s", "time_step"):  # fmt: skip
            assert logged[f"train/{key}"] == pytest.approx(row[key]), key
        if row["drift_scanned_q"]:
            assert logged["train/drift_scanned_q/p50"] == pytest.approx(row["drift_scanned_q"][1])
    for row in held_out:
        assert history[row["step"]]["eval/mean_at_k"] == pytest.approx(row["mean_at_k"])
    assert metrics[1]["replay_ages"] == [1, 1]
    assert history[2]["train/replay_ages/_type"] == "histogram"
