"""hdr's vllm backend on the real vLLM engine (tests/real_vllm.py), one engine for the module on
a chain bed (Qwen2.5's tokenizer; each listed token has a fixed successor): the three finish
reasons, an EOS as the last allowed token, a stop string whose last token overhangs it, and
multi-turn rollouts against the real retrieval server that match the hf backend's token for
token, where both tags (`</search>`, `</answer>`) span several tokens."""

from __future__ import annotations

import pytest
from real_vllm import NEEDS_VLLM, build_bed, build_chain_bed, engine

from agent_env.generation import GenerationConfig, SamplingParams, build_generator
from agent_env.prompts import PromptConfig

pytestmark = NEEDS_VLLM

IM_END = 151645
CHAINS = [
    (">", " Paris </search>\n\n"),  # after `<search>`: a query; `>\n\n` is one token
    (" Lyon", "</answer>"),  # after `<answer> Lyon`: the closing tag, three tokens
    (" Rome", "<|im_end|>"),  # EOS
    (" Berlin", " Berlin"),  # never ends: the token limit
]
# the compact prompt, its answer turn opened with " Lyon" so the chain closes the answer
PROMPT = PromptConfig.preset("compact").model_copy(update={"observation_suffix": "<answer> Lyon"})


@pytest.fixture(scope="module")
def chain_bed(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-chain")
    return build_chain_bed(build_bed(root / "qwen"), root / "chain", CHAINS)


@pytest.fixture(scope="module")
def tokenizer(chain_bed):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chain_bed))


@pytest.fixture(scope="module")
def gen(chain_bed, tokenizer):
    generator = engine(chain_bed, tokenizer)
    yield generator
    generator.close()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def cases(tokenizer):
    """(context, max_tokens, token ids, finish reason, stop string)."""
    return [
        ("Question: where?\n<search>", 16, ids(tokenizer, " Paris </search>\n\n"), "stop",
         "</search>"),
        ("<answer> Lyon", 16, ids(tokenizer, "</answer>"), "stop", "</answer>"),
        ("The answer is Rome", 16, [IM_END], "eos", None),
        ("The answer is Rome", 1, [IM_END], "eos", None),  # the EOS is the last allowed token
        ("Capital: Berlin", 6, ids(tokenizer, " Berlin") * 6, "length", None),
    ]  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_finish_reasons_stop_strings_eos_and_the_limit(gen, tokenizer, temperature):
    expected = cases(tokenizer)
    contexts = [ids(tokenizer, text) for text, *_ in expected]
    for (_, limit, want, reason, stop), context in zip(expected, contexts, strict=True):
        params = SamplingParams(temperature=temperature, max_tokens=limit)
        (got,) = gen.generate([context], params, seeds=[5])
        assert (got.token_ids, got.finish_reason, got.stop_string) == (want, reason, stop)
        assert min(got.logprobs) > -0.01  # the chain's token has probability ~1
    # the overhang: `</search>` ends inside the last token, which stays whole
    assert tokenizer.decode(expected[0][2][-1:]) == ">\n\n"


def test_one_call_with_every_case_reports_each_ones_own_reason(gen, tokenizer):
    expected = cases(tokenizer)
    contexts = [ids(tokenizer, text) for text, *_ in expected]
    params = SamplingParams(temperature=1.0, max_tokens=16)
    out = gen.generate(contexts, params, seeds=list(range(len(contexts))))
    assert [c.finish_reason for c in out] == ["stop", "stop", "eos", "eos", "length"]
    assert [c.stop_string for c in out[:2]] == ["</search>", "</answer>"]
    assert len(out[4].token_ids) == 16


@pytest.fixture(scope="module")
def examples():
    from agent_env.data import QAExample

    return [
        QAExample(id=str(k), question=q, golden_answers=[a], data_source="test")
        for k, (q, a) in enumerate([("Capital of France?", "Paris"), ("A city?", "Lyon")])
    ]


def rollouts(generator, tokenizer, examples, retrieval_url, temperature):
    from agent_env.retrieval_client import RetrievalClient, RetrievalConfig
    from agent_env.rollout import RolloutConfig, rollout_groups

    config = RolloutConfig(
        prompt=PROMPT, max_turns=3, max_tokens_per_turn=12, temperature=temperature
    )
    with RetrievalClient(RetrievalConfig(urls=[retrieval_url], topk=2), seed=0) as client:
        return rollout_groups(generator, client, tokenizer, examples, 2, config)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_multi_turn_rollouts_match_the_hf_backend(
    gen, chain_bed, tokenizer, examples, retrieval_url, temperature
):
    hf = build_generator(
        GenerationConfig(backend="hf", dtype="float32"),
        model_dir=chain_bed,
        tokenizer=tokenizer,
        prompt=PROMPT,
    )
    by_vllm = rollouts(gen, tokenizer, examples, retrieval_url, temperature)
    by_hf = rollouts(hf, tokenizer, examples, retrieval_url, temperature)
    query_end = ids(tokenizer, " Paris </search>\n\n")
    for group_v, group_h in zip(by_vllm.groups, by_hf.groups, strict=True):
        for v, h in zip(group_v, group_h, strict=True):
            assert v.response_ids == h.response_ids and v.loss_mask == h.loss_mask
            assert (v.turns, v.answer, v.observations) == (h.turns, h.answer, h.observations)
            # search (with the overhanging `>\n\n`), the server's documents, the answer
            assert (v.turns, v.searches, v.answer) == (2, 1, "Lyon")
            assert v.response_ids[: len(query_end)] == query_end
            assert v.loss_mask[: len(query_end)] == [1] * len(query_end)
            assert "<information>" in tokenizer.decode(v.response_ids)
    assert by_vllm.retrieval_calls == by_hf.retrieval_calls == 1  # one batched search turn
