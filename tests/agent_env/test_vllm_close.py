"""One vLLM engine after another in one process (`hdr calibrate`'s points, an experiment's runs
and evaluations), on the real engine (tests/real_vllm.py): vLLM sizes a new engine's KV cache
by what the process already holds, so an engine that is done must give its memory back at once
(`VLLMGenerator.close`). Its own module: in-process engines share vLLM's global parallel
state, so none may be alive beside these."""

from __future__ import annotations

import pytest
from real_vllm import NEEDS_VLLM, build_bed, engine

from agent_env.generation import SamplingParams

pytestmark = NEEDS_VLLM


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    return build_bed(tmp_path_factory.mktemp("vllm-close") / "qwen")


def test_engines_one_after_another_each_give_their_memory_back(bed):
    import psutil
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(bed))
    process = psutil.Process()
    before = process.memory_info().rss
    for _ in range(3):  # half the machine's memory each: a third could not fit beside two
        generator = engine(bed, tokenizer, gpu_memory_utilization=0.45)
        held = process.memory_info().rss - before
        out = generator.generate([[9707] * 8], SamplingParams(max_tokens=4), seeds=[1])
        assert len(out[0].token_ids) > 0
        generator.close()
        assert held > 1 << 30 and process.memory_info().rss - before < held / 2


def test_a_sized_kv_cache_starts_beside_a_process_that_already_holds_memory(bed, monkeypatch):
    # on the CPU, gpu_memory_utilization is a share of the machine less what the process holds,
    # so a trainer's process (model, optimizer, kept states) can leave a later engine nothing;
    # kv_cache_gib asks for a size, which holds whatever the process holds
    import torch
    from transformers import AutoTokenizer

    # the tests' engines take their size from vLLM's CPU variable, which overrides any setting
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    tokenizer = AutoTokenizer.from_pretrained(str(bed))
    held = torch.ones(3 << 28, dtype=torch.float32)  # 3 GiB, touched: the trainer's memory
    generator = engine(bed, tokenizer, kv_cache_gib=0.5)
    cache = generator.llm.llm_engine.vllm_config.cache_config
    assert cache.kv_cache_memory_bytes == 1 << 29
    out = generator.generate([[9707] * 8], SamplingParams(max_tokens=4), seeds=[1])
    assert len(out[0].token_ids) > 0
    generator.close()
    del held
