"""Training on the fidelity bed (Qwen2.5's tokenizer, a tiny random Qwen2 model) against the
real test server: `hdr sft` then `hdr train`, and configs/search-r1-qwen2.5-3b.yaml run for
two steps on the CPU with the tiny model in place of the 3B one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import REPO, TINY_CPU, tiny_overrides

from core.config import load_config
from trainer.config import TrainConfig

SEARCH_R1_3B = REPO / "configs" / "search-r1-qwen2.5-3b.yaml"


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_search_r1_3b_config_validates_with_fp32_master_weights():
    cfg = load_config(TrainConfig, SEARCH_R1_3B)
    assert (cfg.model.dtype, cfg.model.compute_dtype) == ("float32", "bfloat16")
    assert (cfg.generation.backend, cfg.generation.tensor_parallel_size) == ("vllm", 1)
    assert cfg.generation.seed == cfg.seed
    assert cfg.rollout.prompt.chat_template and "{question}" in cfg.rollout.prompt.template


@pytest.mark.slow  # about a minute on an idle 2-core machine: the 151,936-row output layer
@pytest.mark.timeout(1800)
def test_sft_then_train_on_the_qwen_bed(qwen_policy_dir, small_qa, retrieval_url, tmp_path):
    """`hdr sft` on scripted trajectories, then 3 GRPO steps with replay, on the real BPE."""
    from transformers import AutoModelForCausalLM

    from trainer.loop import train
    from trainer.tools.sft import run_sft

    sft_dir = tmp_path / "sft"
    sft_cfg = load_config(
        TrainConfig,
        TINY_CPU,
        tiny_overrides(
            retrieval_url, sft_dir, small_qa, tmp_path / "unused",
            f"sft.init_model={qwen_policy_dir}", "sft.epochs=2", "sft.lr=3e-3",
            "sft.max_examples=32", "sft.batch_size=16",
        ),
    )  # fmt: skip
    assert run_sft(sft_cfg) == sft_dir
    log = read_jsonl(tmp_path / "sft.sft-log.jsonl")
    assert [r["epoch"] for r in log] == [1, 2] and log[1]["loss"] < log[0]["loss"]
    overrides = tiny_overrides(
        retrieval_url, sft_dir, small_qa, tmp_path / "run", "steps=3", "eval.every=0",
        "checkpoint.save_every=0", "grpo.batch_prompts=2",
        "replay.store_zero_advantage=true",  # replay runs whatever the rewards
    )  # fmt: skip
    run_dir = train(load_config(TrainConfig, TINY_CPU, overrides))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["fresh_tokens"] > 0 and r["env_calls"] >= 1 for r in rows)
    assert all(r["logprob_gap_max"] < 1e-4 for r in rows)  # fp32 hf == teacher forcing
    assert any(r["replayed_groups"] for r in rows[1:])
    final = AutoModelForCausalLM.from_pretrained(str(run_dir / "final"), dtype=torch.float32)
    assert final.config.model_type == "qwen2" and final.config.vocab_size == 151936
    start = AutoModelForCausalLM.from_pretrained(str(sft_dir), dtype=torch.float32)
    moved = any(
        not torch.equal(a, b) for a, b in zip(final.parameters(), start.parameters(), strict=True)
    )
    # a barely trained random model often earns no reward at all: then no gradient, no move
    assert moved == any(r["grad_norm"] > 0 for r in rows)


def search_r1_parquet(small_qa, path):
    """The small task in Search-R1's parquet layout (what the 3B config's data files hold)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for line in small_qa.read_text().splitlines()[:32]:
        ex = json.loads(line)
        rows.append(
            {
                "id": ex["id"],
                "question": ex["question"],
                "data_source": "nq",
                "prompt": [{"role": "user", "content": ex["question"]}],
                "reward_model": {"ground_truth": {"target": ex["golden_answers"]}},
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.slow
@pytest.mark.timeout(3600)  # 26 min here: a random model writes every turn to its limit
def test_search_r1_3b_config_runs_end_to_end_on_a_tiny_qwen2(
    qwen_policy_dir, small_qa, retrieval_url, tmp_path
):
    """configs/search-r1-qwen2.5-3b.yaml as written (instruct prompt through the chat
    template, 4 turns x 500 tokens, 4,096 response tokens, bf16 autocast on fp32 master
    weights, k3 KL to a bf16 reference, gradient checkpointing), with only what the CPU
    forces substituted: the tiny model, the hf backend, the CPU, the test server and data
    (and so no check of the server's index), 2 steps of 2 prompts x 2 responses (so 2 rollout
    shards), and no periodic evaluation."""
    from transformers import AutoModelForCausalLM

    from trainer.loop import train

    model_dir = tmp_path / "tiny-qwen2"
    shutil.copytree(qwen_policy_dir, model_dir)
    data = search_r1_parquet(small_qa, tmp_path / "train.parquet")
    overrides = [
        f"model.path={model_dir}",
        "model.device=cpu",
        "generation.backend=hf",
        "generation.device=cpu",
        f"data.train={data}",
        f"data.eval={data}",
        f"retrieval.urls=[{retrieval_url}]",
        "retrieval.expect_encoder=null",  # the test server's index, not wiki-18 with e5
        "retrieval.expect_documents=null",
        f"out_dir={tmp_path / 'run'}",
        "steps=2",
        "grpo.warmup_steps=0",
        "grpo.batch_prompts=2",
        "grpo.group_size=2",
        "distributed.rollout_shards=2",  # the file's 8 shards need 8 prompts or more
        "eval.every=0",
        "eval.at_start=false",
        "log.progress=false",
    ]
    cfg = load_config(TrainConfig, SEARCH_R1_3B, overrides)
    file_cfg = load_config(TrainConfig, SEARCH_R1_3B)
    assert cfg.rollout == file_cfg.rollout  # the same prompt and limits
    assert (cfg.model.compute_dtype, cfg.generation.dtype, cfg.grpo.beta) == (
        "bfloat16",
        "bfloat16",
        0.001,
    )
    run_dir = train(cfg)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["fresh_tokens"] > 0 and r["grad_norm"] > 0 for r in rows)
    assert all(0 < r["logprob_gap_mean"] < 1 for r in rows)  # bf16: a real, small gap
    final = AutoModelForCausalLM.from_pretrained(str(run_dir / "final"), dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    moved = {
        name: a != b
        for (name, a), b in zip(final.named_parameters(), start.parameters(), strict=True)
    }
    # lr 1e-6 on fp32 master weights: every block tensor moves (on bf16 weights none would).
    # The random model earns no reward, so the gradient is the KL term's alone (norm ~3e-4);
    # embedding elements whose gradient is near AdamW's eps move less than fp32's spacing,
    # so the embedding is checked by rows.
    embedding = moved.pop("model.embed_tokens.weight")
    assert all(m.float().mean() > 0.9 for m in moved.values())
    assert embedding.any(dim=1).float().mean() > 0.9
