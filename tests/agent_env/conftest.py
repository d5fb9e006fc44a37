"""Fixtures of the agent_env tests: a real tiny policy built into tmp, wiki-vital questions
whose answers are in the session's small index, and a retrieval client on the live server."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`hdr init-model` in-process on a corpus sample. init_std 0.3 makes the random model's
    distributions peaked, so a log-prob mismatch (top-k, position ids) shows clearly."""
    from models.tiny import TinyPolicyConfig, init_tiny_policy, vital_corpus_texts

    out = tmp_path_factory.mktemp("tiny-policy")
    config = TinyPolicyConfig(max_texts=6000, init_std=0.3)
    return init_tiny_policy(out, vital_corpus_texts(limit=2000), config)


@pytest.fixture(scope="session")
def tokenizer(tiny_policy_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_policy_dir))


@pytest.fixture(scope="session")
def tiny_model(tiny_policy_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def indexed_questions(small_corpus: Path):
    """wiki-vital questions (both splits) whose article is in the small index."""
    import json

    from agent_env.data import wiki_vital_examples
    from retrieval_server.index.corpus import split_contents

    lines = small_corpus.read_text().splitlines()
    titles = {split_contents(json.loads(line)["contents"])[0] for line in lines}
    return [ex for ex in wiki_vital_examples("all") if ex.golden_answers[0] in titles]


@pytest.fixture
def client(retrieval_url: str):
    from agent_env.retrieval_client import RetrievalClient, RetrievalConfig

    with RetrievalClient(RetrievalConfig(urls=[retrieval_url], topk=3), seed=0) as c:
        yield c
