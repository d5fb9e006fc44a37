"""The cost ledger (`cost_*` in metrics.jsonl) on runs whose counts can be checked by hand.

The hand-checkable run uses the scripted policy: each group's G responses are identical
(search the question, answer Doc 1), so every group is one distinct row of known length,
every advantage is 0, and the buffer (told to store such groups) is scanned in a known
order. The expected counts are recomputed here from a second scripted rollout of the same
prompts: what the masks and row lengths say.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_CPU, tiny_overrides

from core.config import load_config
from headroom_drift import Selection, StoredGroup
from trainer.config import TrainConfig
from trainer.fresh import sample_prompts
from trainer.loop import train
from trainer.record import update_counts
from trainer.telemetry import COST_KEYS, COUNT_KEYS, StepCost, cost_totals

B, G, R = 2, 3, 2


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def scripted_config(url, policy, qa, out, *extra) -> TrainConfig:
    return load_config(
        TrainConfig,
        TINY_CPU,
        tiny_overrides(
            url, policy, qa, out,
            "steps=3", f"grpo.batch_prompts={B}", f"grpo.group_size={G}", "grpo.micro_batch=4",
            f"replay.budget={R}", "replay.capacity=8", "replay.tau=1e9",
            "replay.store_zero_advantage=true", "generation.backend=scripted",
            "rollout.reward=exact_match", "rollout.format_weight=0", "eval.every=0",
            "checkpoint.save_every=0", "log.tensorboard=false", *extra,
        ),
    )  # fmt: skip


@pytest.fixture(scope="module")
def scripted_run(tiny_policy, small_qa, retrieval_url, tmp_path_factory):
    cfg = scripted_config(
        retrieval_url, tiny_policy, small_qa, tmp_path_factory.mktemp("ledger") / "run"
    )
    return cfg, read_metrics(train(cfg))


def expected_rollouts(cfg: TrainConfig, steps: int) -> dict[int, list[list]]:
    """The scripted trajectories of each step, rolled out again outside the trainer."""
    from transformers import AutoTokenizer

    from agent_env.data import load_task
    from agent_env.generation.scripted import ScriptedGenerator
    from agent_env.retrieval_client import RetrievalClient
    from agent_env.rollout import rollout_groups

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    generator = ScriptedGenerator(tokenizer, cfg.rollout.prompt)
    examples = load_task(cfg.data.train, cfg.data.train_split)
    out = {}
    with RetrievalClient(cfg.retrieval) as client:
        for step in range(1, steps + 1):
            prompts = sample_prompts(examples, cfg.seed, step, B)
            out[step] = rollout_groups(generator, client, tokenizer, prompts, G, cfg.rollout).groups
    return out


def test_ledger_counts_equal_what_the_masks_say(scripted_run):
    cfg, rows = scripted_run
    rolled = expected_rollouts(cfg, 3)
    row_len = {
        s: [len(g[0].prompt_ids) + len(g[0].response_ids) for g in groups]
        for s, groups in rolled.items()
    }
    for groups in rolled.values():  # the scripted policy: a group is one distinct row
        assert all(t.response_ids == g[0].response_ids for g in groups for t in g)
    replayed_from = {1: [], 2: [1], 3: [2]}  # R=2=b: the newest step's groups (ties: newest)
    for row in rows:
        s, trajs = row["step"], [t for g in rolled[row["step"]] for t in g]
        assert set(COST_KEYS) <= set(row)
        assert row["cost_prompt_tokens"] == sum(len(t.prompt_ids) for t in trajs)
        assert row["cost_generated_tokens"] == sum(sum(t.loss_mask) for t in trajs)
        assert row["cost_observation_tokens"] == sum(
            len(t.loss_mask) - sum(t.loss_mask) for t in trajs
        )
        assert row["cost_behaviour_tf_tokens"] == sum(row_len[s])  # duplicates scored once
        replayed_len = sum(sum(row_len[p]) for p in replayed_from[s])
        assert row["cost_scan_tf_tokens"] == replayed_len  # each candidate scanned once
        assert row["cost_update_tf_tokens"] == G * (sum(row_len[s]) + replayed_len)
        assert row["cost_fresh_groups"] == B and row["cost_search_calls"] == B * G
        assert row["cost_env_requests"] == 1  # one turn searched, one batched request
        assert row["cost_passages"] == B * G * cfg.retrieval.topk
        assert row["cost_replayed_groups"] == row["cost_scanned_groups"] == R * (s > 1)
        assert row["cost_update_groups"] == B + R * (s > 1)
        assert row["cost_informative_groups"] == row["cost_informative_tokens"] == 0
        assert row["cost_cpu_update_s"] > 0 and row["cost_cpu_rollout_s"] > 0
    totals = cost_totals(rows)
    assert totals["cost_search_calls"] == 3 * B * G
    assert totals["cost_update_tf_tokens"] == sum(r["cost_update_tf_tokens"] for r in rows)


def test_update_counts_count_informative_groups_and_tokens():
    def stored(adv, mask_rows) -> StoredGroup:
        mask = torch.tensor(mask_rows, dtype=torch.float32)
        return StoredGroup(
            group_id="g", input_ids=torch.ones_like(mask, dtype=torch.long),
            attention_mask=torch.ones_like(mask, dtype=torch.long), loss_mask=mask,
            gen_logprobs=torch.zeros_like(mask), rewards=torch.tensor(adv),
            advantages=torch.tensor(adv), headroom=0.0, entered_step=0,
        )  # fmt: skip

    live = stored([1.0, -1.0, 0.0], [[0, 1, 1], [0, 1, 0], [1, 1, 1]])  # rows 0, 1 count: 3
    flat = stored([0.0, 0.0, 0.0], [[0, 1, 1], [0, 1, 1], [0, 1, 1]])
    replayed = stored([0.5, -0.5, 0.0], [[1, 1, 1], [0, 0, 1], [0, 1, 1]])  # 4
    cost = StepCost(**update_counts([live, flat], Selection(groups=[replayed], scanned=5)))
    assert cost.update_groups == 3 and cost.informative_groups == 2
    assert cost.informative_tokens == 3 + 4
    assert cost.replayed_groups == 1 and cost.scanned_groups == 5


@pytest.mark.parametrize("arm", ["headroom_drift"])
def test_same_config_twice_gives_the_same_count_ledger(
    arm, sft_policy, small_qa, retrieval_url, tmp_path_factory
):
    """Counts are machine-independent: a real (sampling) tiny policy, the same config twice."""
    root = tmp_path_factory.mktemp("ledger-twice")
    ledgers = []
    for n in range(2):
        cfg = load_config(
            TrainConfig,
            TINY_CPU,
            tiny_overrides(
                retrieval_url, sft_policy, small_qa, root / str(n), "steps=3", f"replay.rule={arm}",
                "eval.every=0", "checkpoint.save_every=0", "log.tensorboard=false",
            ),
        )  # fmt: skip
        rows = read_metrics(train(cfg))
        ledgers.append([{k: r[k] for k in COUNT_KEYS} for r in rows])
    assert ledgers[0] == ledgers[1]
    assert sum(r["cost_generated_tokens"] for r in ledgers[0]) > 0
