"""vLLM backend (GPU only; skipped here): stop strings, sampler log-probs, weight sync."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
        reason="needs a CUDA GPU and vLLM (pip install -e '.[gpu]')",
    ),
]


def test_vllm_logprobs_match_teacher_forcing_and_weights_sync(tiny_policy_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from agent_env.generation import GenerationConfig, SamplingParams, build_generator
    from agent_env.prompts import PromptConfig, prompt_text

    prompt = PromptConfig.preset("compact")
    config = GenerationConfig(backend="vllm", dtype="float32", gpu_memory_utilization=0.2)
    gen = build_generator(config, model_dir=tiny_policy_dir, tokenizer=tokenizer, prompt=prompt)
    contexts = [
        tokenizer.encode(prompt_text(prompt, q, tokenizer), add_special_tokens=False)
        for q in ("1968 film by Stanley Kubrick", "Art movement")
    ]
    out = gen.generate(contexts, SamplingParams(temperature=1.0, max_tokens=16))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir), dtype=torch.float32).cuda()
    for ctx, completion in zip(contexts, out, strict=True):
        ids = torch.tensor([ctx + completion.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0, len(ctx) - 1 : -1].float()
        forced = torch.log_softmax(logits, -1).gather(1, ids[0, len(ctx) :, None])[:, 0]
        assert torch.allclose(forced.cpu(), torch.tensor(completion.logprobs), atol=1e-3)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    before = gen.generate(contexts, greedy)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    gen.sync_weights(model)
    after = gen.generate(contexts, greedy)
    assert [c.token_ids for c in before] != [c.token_ids for c in after]
