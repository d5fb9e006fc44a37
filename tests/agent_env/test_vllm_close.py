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
