"""The vllm backend against a recording stand-in for vLLM 0.33's offline API (tests/fakes/vllm,
the `fake_vllm` fixture): how the engine is built, per-request seeds, sleep and wake around
the weight sync, the sync's coverage check, and an EOS sampled as a turn's last allowed token
through the real rollout loop and a real server. The Qwen2 bed (Qwen2.5's tokenizer) is the
model directory the engine is built from."""

from __future__ import annotations

import pytest

from agent_env.generation import GenerationConfig, SamplingParams, build_generator
from agent_env.prompts import PromptConfig
from core.errors import UserError

IM_END, ENDOFTEXT = 151645, 151643


def build(model_dir, tokenizer, **settings):
    config = GenerationConfig(backend="vllm", dtype="bfloat16", **settings)
    return build_generator(config, model_dir=model_dir, tokenizer=tokenizer, prompt=PromptConfig())


def events(fake, *kinds: str) -> list[tuple]:
    return [e for e in fake.EVENTS if not kinds or e[0] in kinds]


def test_one_process_builds_one_in_process_engine_with_the_configured_settings(
    fake_vllm, qwen_policy_dir, qwen_tokenizer
):
    gen = build(
        qwen_policy_dir, qwen_tokenizer, seed=3, max_model_len=512, max_num_seqs=64,
        enable_sleep_mode=True,
    )  # fmt: skip
    (built,) = [e[1] for e in events(fake_vllm, "LLM")]
    assert built["kwargs"] == {
        "dtype": "bfloat16",
        "gpu_memory_utilization": 0.5,
        "seed": 3,
        "tensor_parallel_size": 1,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm",
        "enable_sleep_mode": True,
        "max_model_len": 512,
        "max_num_seqs": 64,
    }  # no distributed_executor_backend: one process, the uniprocess executor
    assert built["device"] == "cuda:0" and built["in_process"]  # the inherited 1 was overridden
    assert gen.eos == {IM_END, ENDOFTEXT}  # tokenizer's EOS and generation config's list
    assert gen.max_model_len == 512


def test_an_engine_built_out_of_process_is_refused_in_one_line(
    fake_vllm, qwen_policy_dir, qwen_tokenizer, monkeypatch
):
    monkeypatch.setattr(fake_vllm, "OUT_OF_PROCESS", True)
    with pytest.raises(UserError, match="built its engine out of process"):
        build(qwen_policy_dir, qwen_tokenizer)


def test_each_request_gets_its_seed_and_a_full_context_is_not_sent(
    fake_vllm, qwen_policy_dir, qwen_tokenizer
):
    gen = build(qwen_policy_dir, qwen_tokenizer, max_model_len=64)
    contexts = [[9707] * 10, [9707] * 64, [9707] * 12]  # the middle one fills the engine
    out = gen.generate(contexts, SamplingParams(max_tokens=8), seeds=[5, 6, 7])
    (call,) = events(fake_vllm, "generate")
    assert call == ("generate", 2, [5, 7])  # one call, the full context left out
    assert (out[1].finish_reason, out[1].token_ids) == ("length", [])
    assert out[0].finish_reason == "stop" and out[0].stop_string == "</search>"
    gen.generate(contexts[:1], SamplingParams(max_tokens=8))
    assert events(fake_vllm, "generate")[-1] == ("generate", 1, [None])  # unseeded: engine RNG


def test_the_weight_sync_loads_every_parameter_or_refuses(
    fake_vllm, qwen_policy_dir, qwen_tokenizer, qwen_model
):
    gen = build(qwen_policy_dir, qwen_tokenizer)
    engine_params = len(gen.llm.model.params)
    gen.sync_weights(qwen_model)
    assert events(fake_vllm)[1:] == [
        ("apply_model",),
        ("load_weights", engine_params),
        ("reset_prefix_cache",),
    ]
    fake_vllm.DROPPED.add("model.norm.weight")  # a name the state dict no longer reaches
    with pytest.raises(UserError) as refused:
        gen.sync_weights(qwen_model)
    assert str(refused.value).startswith(
        f"the weight sync loaded {engine_params - 1} of {engine_params} parameters of vLLM's"
        " model; not loaded: model.norm.weight."
    )
    assert events(fake_vllm)[-1] == ("load_weights", engine_params - 1)  # no cache reset


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
    kinds = [e[:2] if e[0] in ("sleep", "wake_up") else e[:1] for e in events(fake_vllm)[1:]]
    assert kinds == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("apply_model",),
        ("load_weights",),
        ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache",),
        ("generate",),
    ]


def test_without_sleep_mode_sleep_does_nothing(fake_vllm, qwen_policy_dir, qwen_tokenizer):
    gen = build(qwen_policy_dir, qwen_tokenizer)
    gen.sleep()
    gen.generate([[9707]], SamplingParams(max_tokens=4))
    assert [e[0] for e in events(fake_vllm)] == ["LLM", "generate"]


def test_an_eos_as_the_last_allowed_token_ends_the_trajectory(
    fake_vllm, qwen_policy_dir, qwen_tokenizer, retrieval_url
):
    """vLLM 0.11 reported an EOS sampled as a turn's last allowed token as "length"; hdr kept
    it mid-context, appended the invalid-action message and generated on. Recorded shape:
    four tokens, the fourth <|im_end|>, finish_reason "length", stop_reason None."""
    from agent_env.data import QAExample
    from agent_env.retrieval_client import RetrievalClient, RetrievalConfig
    from agent_env.rollout import RolloutConfig, rollout_groups

    words = qwen_tokenizer.encode(" I know it", add_special_tokens=False)[:3]

    def respond(last_token):
        return lambda prompt_ids, sampling: ([*words, last_token], "length", None)

    config = RolloutConfig(max_turns=2, max_tokens_per_turn=4)
    example = QAExample(
        id="q", question="Which city?", golden_answers=["Paris"], data_source="test"
    )
    gen = build(qwen_policy_dir, qwen_tokenizer)
    results = {}
    with RetrievalClient(RetrievalConfig(urls=[retrieval_url]), seed=0) as client:
        for name, last in (("eos", IM_END), ("cut", words[0])):
            fake_vllm.LLM.responder = staticmethod(respond(last))
            results[name] = rollout_groups(gen, client, qwen_tokenizer, [example], 1, config)
    ended = results["eos"].groups[0][0]
    assert ended.turns == 1 and ended.observations == [] and ended.answer is None
    assert ended.response_ids == [*words, IM_END] and ended.loss_mask == [1] * 4
    cut = results["cut"].groups[0][0]  # a real cut: the invalid-action message, then more turns
    assert cut.turns == 3 and cut.observations[0] == config.prompt.invalid_action_message
