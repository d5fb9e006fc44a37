"""A short real training run: tiny policy after a short SFT, the test retrieval server, the
small task. Checks the run directory against docs/design.md ("The run directory") and the replay
mechanics."""

import json

import pytest
import torch
from conftest import TINY_CPU, replay_state, tiny_overrides

from core.config import load_config
from trainer.checkpoint import list_checkpoints, open_checkpoint
from trainer.config import TrainConfig
from trainer.loop import train

METRIC_KEYS = [
    "step",
    "reward_mean",
    "em_mean",
    "entropy",
    "logprob_gap_mean",
    "logprob_gap_max",
    "loss",
    "fresh_tokens",
    "replay_tokens",
    "replayed_groups",
    "scanned_groups",
    "acceptance_rate",
    "drift_scanned_q",
    "drift_admitted_q",
    "headroom_scanned_q",
    "headroom_admitted_q",
    "replay_ages",
    "replay_counts",
    "headroom_stored",
    "headroom_refreshed",
    "buffer_size",
    "env_calls",
    "env_calls_total",
    "search_calls",
    "search_calls_total",
    "time_generation",
    "time_retrieval",
    "time_scoring",
    "time_selection",
    "time_update",
    "time_step",
    "wall_time_total",
]
EVAL_KEYS = [
    "step",
    "env_calls_total",
    "wall_time_total",
    "mean_at_k",
    "best_at_k",
    "greedy_em",
    "k",
    "num_questions",
]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def short_run(sft_policy, small_qa, retrieval_url, tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "run"
    cfg = load_config(
        TrainConfig, TINY_CPU, tiny_overrides(retrieval_url, sft_policy, small_qa, out)
    )
    return train(cfg)


def test_metrics_have_every_contract_key(short_run):
    rows = read_jsonl(short_run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for row in rows:
        assert set(METRIC_KEYS) <= set(row), set(METRIC_KEYS) - set(row)
        assert row["fresh_tokens"] > 0 and row["env_calls"] >= 1
        assert row["search_calls"] >= row["env_calls"]  # one request carries many queries
        assert row["buffer_size"] <= 6
        assert row["logprob_gap_max"] < 1e-4  # hf sampling in fp32 == teacher forcing
        assert "replay_tau" not in row  # the fixed gate: nothing of the adaptive one's
    totals = [r["env_calls_total"] for r in rows]
    assert totals == sorted(totals) and totals[-1] == sum(r["env_calls"] for r in rows)
    evals = read_jsonl(short_run / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 4]
    for e in evals:
        assert set(EVAL_KEYS) <= set(e) and e["num_questions"] == 4 and e["k"] == 2


def test_groups_are_replayed_after_they_entered(short_run):
    rows = read_jsonl(short_run / "metrics.jsonl")
    assert rows[0]["replayed_groups"] == 0  # nothing stored before the first update
    replayed = [r for r in rows if r["replayed_groups"]]
    assert replayed, "no step replayed anything"
    for r in replayed:
        assert r["replayed_groups"] <= 2
        assert all(age >= 1 for age in r["replay_ages"])  # never the step's own groups
        assert r["scanned_groups"] >= r["replayed_groups"]
        assert len(r["headroom_stored"]) == r["replayed_groups"]
        assert r["replay_tokens"] > 0
    groups = read_jsonl(short_run / "groups.jsonl")
    assert {"group_id", "entered_step", "initial_headroom", "replay_count"} <= set(groups[0])
    assert len({g["group_id"] for g in groups}) == len(groups)
    assert sum(g["replay_count"] for g in groups) == sum(r["replayed_groups"] for r in rows)


def test_checkpoints_and_final_model(short_run, sft_policy):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    found = list_checkpoints(short_run / "checkpoints")
    assert [step for step, _ in found] == [4, 5]  # keep_last=2
    ckpt = open_checkpoint(short_run)
    assert ckpt.step == 5
    groups = replay_state(ckpt.path)["groups"]
    assert len(groups) == read_jsonl(short_run / "metrics.jsonl")[-1]["buffer_size"]
    final = AutoModelForCausalLM.from_pretrained(str(short_run / "final"))
    AutoTokenizer.from_pretrained(str(short_run / "final"))
    start = AutoModelForCausalLM.from_pretrained(str(sft_policy))
    moved = [
        not torch.equal(a, b) for a, b in zip(final.parameters(), start.parameters(), strict=True)
    ]
    assert any(moved)
    assert list((short_run / "tb").iterdir())


def test_existing_run_dir_is_refused(short_run, sft_policy, small_qa, retrieval_url):
    from core.errors import UserError

    cfg = load_config(
        TrainConfig, TINY_CPU, tiny_overrides(retrieval_url, sft_policy, small_qa, short_run)
    )
    with pytest.raises(UserError, match="--resume"):
        train(cfg)
