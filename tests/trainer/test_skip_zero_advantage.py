"""`grpo.skip_zero_advantage`: rows whose advantage is 0 are not forwarded, and the update is
the one the whole batch gives (their loss is 0; their tokens still count in the token mean).
Two real short runs of the tiny policy against the test server, with and without it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_CPU, tiny_overrides
from safetensors.torch import load_file

from core.config import load_config
from core.errors import UserError
from trainer.config import TrainConfig
from trainer.loop import train


def run(sft_policy, small_qa, retrieval_url, out, *extra):
    # F1 plus the format term: about half of a barely trained policy's groups score all 0
    overrides = tiny_overrides(
        retrieval_url, sft_policy, small_qa, out, "steps=3", "eval.every=0",
        "checkpoint.save_every=0", "rollout.reward=f1", "rollout.format_weight=0.5",
        "grpo.lr=1e-2", *extra,
    )  # fmt: skip
    run_dir = train(load_config(TrainConfig, TINY_CPU, overrides))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return load_file(run_dir / "final" / "model.safetensors"), rows


@pytest.mark.parametrize("layers", [[], ["model.train_layers=1"]], ids=["all", "top-1"])
def test_skipping_zero_advantage_rows_gives_the_same_update(
    sft_policy, small_qa, retrieval_url, tmp_path, layers
):
    whole, whole_rows = run(sft_policy, small_qa, retrieval_url, tmp_path / "whole", *layers)
    skipped, skipped_rows = run(
        sft_policy, small_qa, retrieval_url, tmp_path / "skip", *layers,
        "grpo.skip_zero_advantage=true",
    )  # fmt: skip
    first, first_skipped = whole_rows[0], skipped_rows[0]
    assert first["reward_mean"] == first_skipped["reward_mean"]  # the same rollouts
    uniform = first["cost_update_groups"] - first["cost_informative_groups"]
    assert uniform > 0, "no group had equal rewards: the test would show nothing"
    # fewer rows forwarded, in the behaviour pass and in the update
    assert first_skipped["cost_behaviour_tf_tokens"] < first["cost_behaviour_tf_tokens"]
    assert first_skipped["cost_update_tf_tokens"] < first["cost_update_tf_tokens"]
    for a, b in zip(whole_rows, skipped_rows, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-7)
    start = load_file(sft_policy / "model.safetensors")
    assert any(not torch.equal(start[k], whole[k]) for k in start), "the update moved nothing"
    for name, tensor in whole.items():
        torch.testing.assert_close(skipped[name], tensor, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("grpo.beta=0.1", "grpo.beta=0"),
        ("replay.store_zero_advantage=true", "replay.store_zero_advantage=false"),
        ("async_rollout.workers=1", "no rollout workers"),
    ],
)
def test_what_a_skipped_row_would_change_is_refused(override, message):
    with pytest.raises(UserError, match=message):
        load_config(TrainConfig, TINY_CPU, ["grpo.skip_zero_advantage=true", override])
