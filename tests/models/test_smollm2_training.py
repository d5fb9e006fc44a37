"""GRPO steps with Headroom-Drift Replay on the real model, SmolLM2-135M-Instruct, as
configs/smollm2-cpu.yaml runs it: vLLM's CPU engine generating (so the vLLM environment runs
this), bf16 compute, the top 4 of 30 layers trained above the kept frozen bottom, zero-advantage
rows skipped; the real retrieval server over the small index."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from real_vllm import NEEDS_VLLM, engine_start_beside_numba
from safetensors.torch import load_file

pytestmark = NEEDS_VLLM
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "smollm2-cpu.yaml"


@pytest.fixture(scope="module")
def trained(smollm2_dir: Path, retrieval_url: str, tmp_path_factory) -> Path:
    from corpora import write_small_qa

    from core.config import load_config
    from trainer.config import TrainConfig
    from trainer.loop import train

    root = tmp_path_factory.mktemp("smollm2-train")
    qa = write_small_qa(root / "qa.jsonl")
    overrides = [
        f"model.path={smollm2_dir}", f"data.train={qa}", f"data.eval={qa}",
        f"retrieval.urls=[{retrieval_url}]", f"out_dir={root / 'run'}", "steps=3",
        "grpo.batch_prompts=4", "grpo.group_size=4", "grpo.warmup_steps=0",
        # F1 plus a format term: the untrained model's rewards vary within a group
        "rollout.reward=f1", "rollout.format_weight=0.5",
        "replay.tau=100", "eval.every=0", "checkpoint.save_every=0",
        "log.progress=false", "log.tensorboard=false", "generation.kv_cache_gib=1",
    ]  # fmt: skip
    # the server's BM25 compiles its numba kernels on a first search, before the engine starts
    # with llvmlite's library set aside (real_vllm.engine_start_beside_numba)
    httpx.post(f"{retrieval_url}/retrieve", json={"queries": ["a"], "retriever": "bm25"})
    with engine_start_beside_numba():
        return train(load_config(TrainConfig, CONFIG, overrides))


def test_a_step_rolls_out_scores_replays_and_updates(trained):
    rows = [json.loads(x) for x in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["fresh_tokens"] > 0 and r["search_calls"] > 0 for r in rows)
    assert sum(r["replayed_groups"] for r in rows[1:]) > 0, "no stored group was replayed"
    assert all(r["scanned_groups"] >= r["replayed_groups"] for r in rows)
    # the engine samples in bf16 what the trainer scores in bf16 autocast: close, not equal
    gaps = [r["logprob_gap_mean"] for r in rows if r["logprob_gap_mean"] is not None]
    assert gaps and max(gaps) < 0.1


def test_only_the_top_four_layers_moved(trained, smollm2_dir):
    start = load_file(smollm2_dir / "model.safetensors")
    final = load_file(trained / "final" / "model.safetensors")
    moved = {name for name, tensor in final.items() if not (tensor == start[name]).all()}
    top = {n for n in start if n.startswith(tuple(f"model.layers.{i}." for i in range(26, 30)))}
    assert moved and moved <= top | {"model.norm.weight"}
