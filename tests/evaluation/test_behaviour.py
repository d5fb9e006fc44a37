"""What a policy did (`evaluation/behaviour.py`), on scripted trajectories through the real
rollout loop against the real BM25 server, where every record is known by construction: the
oracle reads (answers the gold at rank 2-3), the Doc-1 policy does not, a query budget cuts
the words sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_env.generation.scripted import ScriptedGenerator
from agent_env.prompts import PromptConfig
from agent_env.rollout import RolloutConfig, rollout_groups
from evaluation.behaviour import Behaviour, correct, observe, summarize_behaviour

PROMPT = PromptConfig(
    template="Question: {question}\n", chat_template=False, response_prefix="<search>"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from models.tiny import TinyPolicyConfig, init_tiny_policy, vital_corpus_texts

    config = TinyPolicyConfig(vocab_size=1024, hidden_size=32, num_layers=1, num_heads=2,
                              intermediate_size=64, max_texts=3000)  # fmt: skip
    out = init_tiny_policy(tmp_path_factory.mktemp("bpe"), vital_corpus_texts(limit=800), config)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def questions(small_corpus: Path):
    """wiki-vital questions whose article is in the small index."""
    from agent_env.data import wiki_vital_examples
    from retrieval_server.index.corpus import split_contents

    lines = small_corpus.read_text().splitlines()
    titles = {split_contents(json.loads(line)["contents"])[0] for line in lines}
    return [ex for ex in wiki_vital_examples("all") if ex.golden_answers[0] in titles][:60]


def records(tokenizer, retrieval_url, questions, oracle: bool, **rollout):
    from agent_env.retrieval_client import RetrievalClient, RetrievalConfig

    config = RolloutConfig(prompt=PROMPT, max_turns=1, doc_words=6, **rollout)
    answers = {ex.question: ex.golden_answers for ex in questions} if oracle else None
    with RetrievalClient(RetrievalConfig(urls=[retrieval_url], topk=3, retriever="bm25")) as c:
        result = rollout_groups(
            ScriptedGenerator(tokenizer, PROMPT, answers), c, tokenizer, questions, 1, config
        )
    trajs = [g[0] for g in result.groups]
    return [observe(t, tokenizer, config) for t in trajs], [correct(t) for t in trajs], trajs


def test_each_record_says_what_the_scripted_policy_did(tokenizer, retrieval_url, questions):
    found, right, trajs = records(tokenizer, retrieval_url, questions, oracle=True)
    for b, ok, t in zip(found, right, trajs, strict=True):
        words = len(t.example.question.split())
        assert (b.valid, b.searches, b.query_words) == (1, 1, words)
        assert b.query_words_in_question == words  # the verbatim copy
        assert b.policy_tokens == sum(t.loss_mask) > 0
        if b.gold_rank > 0:  # the oracle answers the gold when it sees it
            assert (b.answer_rank, ok) == (b.gold_rank, 1)
        else:  # else Doc 1's title
            assert (b.answer_rank, ok) == (1, 0)
    summary = summarize_behaviour([b.as_row() for b in found], right)
    assert summary["valid_format"] == summary["searches_per_response"] == 1.0
    assert summary["gold_rank23"] > 0, "no gold at rank 2-3: the reading case is untested"
    assert summary["em_given_gold_rank1"] == summary["em_given_gold_rank23"] == 1.0
    assert summary["em_given_gold_absent"] == 0.0
    assert summary["gold_rank1"] + summary["gold_rank23"] + summary["gold_absent"] == 1.0


def test_answering_doc_1_never_reads(tokenizer, retrieval_url, questions):
    found, right, _ = records(tokenizer, retrieval_url, questions, oracle=False)
    summary = summarize_behaviour([b.as_row() for b in found], right)
    assert summary["answered_doc1"] == 1.0
    assert summary["em_given_gold_rank1"] == 1.0 and summary["em_given_gold_rank23"] == 0.0


def test_a_query_budget_counts_the_words_sent(tokenizer, retrieval_url, questions):
    found, right, _ = records(tokenizer, retrieval_url, questions, True, max_query_words=2)
    assert {b.query_words for b in found} == {2}
    assert summarize_behaviour([b.as_row() for b in found], right)["query_words_mean"] == 2.0


def test_a_response_without_a_search_has_no_rank():
    row = Behaviour(valid=0, searches=0, policy_tokens=3, gold_rank=-1, answer_rank=-1,
                    query_words=0, query_words_in_question=0)  # fmt: skip
    summary = summarize_behaviour([row.as_row()], [0])
    assert summary["searched"] == 0.0 and summary["query_words_mean"] is None
    assert summary["gold_rank1"] == summary["gold_absent"] == 0.0
