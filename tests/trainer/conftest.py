"""Fixtures for the trainer tests: real tiny Llama models, the small QA task, a short SFT."""

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int = 0, vocab: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def llama():
    return tiny_llama()


REPO = Path(__file__).resolve().parents[2]
TINY_CPU = REPO / "configs" / "tiny-cpu.yaml"


@pytest.fixture(scope="session")
def small_qa(tmp_path_factory) -> Path:
    """FlashRAG JSONL: description -> title for the vital articles in `small_corpus`."""
    from corpora import write_small_qa

    return write_small_qa(tmp_path_factory.mktemp("qa") / "small_qa.jsonl")


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    """An untrained tiny Llama + BPE tokenizer from agent_env (smaller than the default)."""
    from models.tiny import TinyPolicyConfig, init_tiny_policy, vital_corpus_texts

    out = tmp_path_factory.mktemp("policy") / "tiny"
    config = TinyPolicyConfig(
        vocab_size=600, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )
    return init_tiny_policy(out, vital_corpus_texts(limit=300), config)


def tiny_overrides(url: str, model: Path, qa: Path, out: Path, *extra: str) -> list[str]:
    """configs/tiny-cpu.yaml shrunk to test size, on the test server and the small task.
    F1 reward plus a format term give the barely trained policy rewards that vary."""
    return [
        f"retrieval.urls=[{url}]",
        f"model.path={model}",
        f"data.train={qa}",
        f"data.eval={qa}",
        f"out_dir={out}",
        "steps=5",
        "grpo.batch_prompts=4",
        "grpo.group_size=4",
        "grpo.warmup_steps=1",
        "grpo.lr=1e-3",
        "grpo.micro_batch=8",
        "replay.budget=2",
        "replay.capacity=6",
        "replay.tau=1.0",
        "rollout.max_tokens_per_turn=16",
        "rollout.reward=f1",
        "rollout.format_weight=0.5",
        "eval.every=2",
        "eval.num_questions=4",
        "eval.k=2",
        "checkpoint.save_every=1",
        "checkpoint.keep_last=2",
        "log.progress=false",
        "sft.eval_questions=0",
        *extra,
    ]


@pytest.fixture(scope="session")
def sft_policy(tiny_policy, small_qa, retrieval_url, tmp_path_factory) -> Path:
    """The tiny policy after a short `hdr sft` on the small task (uses the tags)."""
    from core.config import load_config
    from trainer.config import TrainConfig
    from trainer.tools.sft import run_sft

    root = tmp_path_factory.mktemp("sft")
    overrides = tiny_overrides(
        retrieval_url,
        root / "model",
        small_qa,
        root / "unused",
        f"sft.init_model={tiny_policy}",
        "sft.epochs=4",
        "sft.lr=5e-3",
        "sft.eval_questions=0",
    )
    return run_sft(load_config(TrainConfig, TINY_CPU, overrides))


def replay_state(checkpoint: Path) -> dict:
    """The replay lifecycle's state a checkpoint holds (`replay.pt`)."""
    return torch.load(Path(checkpoint) / "replay.pt", weights_only=True)


def same_state(a, b) -> bool:
    """Whether two replay states (nested dicts and lists of tensors and plain values) are
    equal: tensors element for element with their dtypes, NaN equal to NaN."""
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(same_state, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return type(a) is type(b) and a == b
