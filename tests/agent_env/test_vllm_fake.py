"""What the real engine cannot show on a CPU, against tests/fakes/vllm (a recording stand-in
for vLLM 0.31 on CUDA, the `fake_vllm` fixture): sleep mode (the CPU build refuses it) and
the device one process's engine takes. Everything else the backend does is tested on the real
engine (test_vllm_engine.py, test_vllm_rollout.py). The Qwen2 bed is the model directory."""

from __future__ import annotations

import pytest

from agent_env.generation import GenerationConfig, SamplingParams, build_generator
from agent_env.prompts import PromptConfig
from core.errors import UserError


def build(model_dir, tokenizer, **settings):
    config = GenerationConfig(backend="vllm", dtype="bfloat16", **settings)
    return build_generator(config, model_dir=model_dir, tokenizer=tokenizer, prompt=PromptConfig())


def kinds(fake) -> list:
    return [e[:2] if e[0] in ("sleep", "wake_up", "collective_rpc") else e[:1] for e in fake.EVENTS]


def test_one_process_builds_one_in_process_engine_on_cuda_0(
    fake_vllm, qwen_policy_dir, qwen_tokenizer
):
    build(qwen_policy_dir, qwen_tokenizer, seed=3, enable_sleep_mode=True)
    (built,) = [e[1] for e in fake_vllm.EVENTS if e[0] == "LLM"]
    assert built["kwargs"]["enable_sleep_mode"] and built["kwargs"]["seed"] == 3
    assert "distributed_executor_backend" not in built["kwargs"]  # the uniprocess executor
    assert built["device"] == "cuda:0" and built["in_process"]  # the inherited 1 was overridden


def test_an_engine_built_out_of_process_is_refused_in_one_line(
    fake_vllm, qwen_policy_dir, qwen_tokenizer, monkeypatch
):
    monkeypatch.setattr(fake_vllm, "OUT_OF_PROCESS", True)
    with pytest.raises(UserError, match="built its engine out of process"):
        build(qwen_policy_dir, qwen_tokenizer)


def test_sleep_frees_the_engine_until_the_sync_wakes_weights_then_kv_cache(
    fake_vllm, qwen_policy_dir, qwen_tokenizer, qwen_model
):
    gen = build(qwen_policy_dir, qwen_tokenizer, enable_sleep_mode=True, sleep_level=2)
    gen.sleep()
    gen.sleep()  # already asleep: nothing more
    with pytest.raises(RuntimeError, match="asleep"):
        gen.generate([[9707]], SamplingParams(max_tokens=4))
    gen.sync_weights(qwen_model)
    gen.generate([[9707]], SamplingParams(max_tokens=4))
    assert kinds(fake_vllm)[1:] == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("collective_rpc", "reload_weights"),
        ("reload_weights",),
        ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache",),
        ("prompt_logprobs",),  # the check, on the awake engine, after the cache reset
        ("generate",),
    ]
    assert gen.last_sync_gap < 1e-3  # the fake scores with the weights it was given


def test_without_sleep_mode_sleep_does_nothing(fake_vllm, qwen_policy_dir, qwen_tokenizer):
    gen = build(qwen_policy_dir, qwen_tokenizer)
    gen.sleep()
    gen.generate([[9707]], SamplingParams(max_tokens=4))
    assert [e[0] for e in fake_vllm.EVENTS] == ["LLM", "generate"]
