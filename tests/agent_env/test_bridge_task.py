"""The multi-turn embedded task `wiki-bridge` and its scripted oracles.

The oracle figures are measured against a real BM25 server over the task's own articles (the
bridge and answer article of every test question) plus the small corpus's 300 articles as
distractors; docs/agent_env.md gives the figures on the whole embedded corpus.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from corpora import SMALL_CORPUS_ARTICLES
from servers import running_server

from agent_env.data import BRIDGE_TEMPLATE, load_task, wiki_bridge_examples
from agent_env.prompts import PromptConfig
from agent_env.rollout import RolloutConfig, rollout_groups

# compact prompt without the forced `<answer>` after a block: the policy chooses its action
MULTI_TURN = PromptConfig.preset("compact").model_copy(update={"observation_suffix": ""})


@pytest.fixture(scope="module")
def bridge_test() -> list:
    return wiki_bridge_examples("test")


@pytest.fixture(scope="module")
def bridge_url(bridge_test, tmp_path_factory) -> Iterator[str]:
    from retrieval_server.index.build import build_index
    from retrieval_server.index.corpus import article_contents, iter_vital_articles, write_corpus

    articles = list(iter_vital_articles())
    wanted = set(range(SMALL_CORPUS_ARTICLES))
    answers = {ex.golden_answers[0] for ex in bridge_test}
    wanted |= {int(ex.id.split("/")[1]) for ex in bridge_test}
    wanted |= {i for i, a in enumerate(articles) if a.title in answers}
    root = tmp_path_factory.mktemp("bridge")
    write_corpus(root / "corpus.jsonl", [article_contents(articles[i]) for i in sorted(wanted)])
    build_index(root / "corpus.jsonl", root / "index", show_progress=False)
    with running_server(root / "index", default_retriever="bm25") as server:
        yield server.url


def test_bridge_task_is_deterministic_and_well_formed(bridge_test):
    from retrieval_server.index.corpus import iter_vital_articles

    articles = list(iter_vital_articles())
    train = wiki_bridge_examples("train")
    assert len(bridge_test) >= 100 and len(train) >= 900
    assert [e.id for e in wiki_bridge_examples("test")] == [e.id for e in bridge_test]
    assert not {e.id for e in train} & {e.id for e in bridge_test}
    assert load_task("wiki-bridge", "test") == bridge_test
    for ex in bridge_test:
        bridge = articles[int(ex.id.split("/")[1])]
        assert ex.question == BRIDGE_TEMPLATE.format(description=bridge.description.strip())
        named = re.compile(r"(?<!\w)" + re.escape(bridge.title) + r"(?!\w)")
        namers = [a.title for a in articles if a.title != bridge.title and named.search(a.extract)]
        assert namers == ex.golden_answers  # exactly one article names the bridge


def oracle_em(tokenizer, url, examples, searches: int) -> tuple[float, float]:
    from agent_env.generation.scripted import ScriptedGenerator
    from agent_env.retrieval_client import RetrievalClient, RetrievalConfig

    oracle = {ex.question: ex.golden_answers for ex in examples}
    config = RolloutConfig(prompt=MULTI_TURN, max_turns=2, doc_words=8, max_obs_tokens=128)
    policy = ScriptedGenerator(tokenizer, MULTI_TURN, oracle=oracle, searches=searches)
    with RetrievalClient(RetrievalConfig(urls=[url], topk=3)) as client:
        result = rollout_groups(policy, client, tokenizer, examples, 1, config)
    trajs = [t for g in result.groups for t in g]
    assert len(trajs) == len(examples)
    return sum(t.reward for t in trajs) / len(trajs), sum(t.searches for t in trajs) / len(trajs)


def test_two_search_oracle_doubles_the_one_search_oracle(tokenizer, bridge_url, bridge_test):
    one, one_searches = oracle_em(tokenizer, bridge_url, bridge_test, searches=1)
    two, two_searches = oracle_em(tokenizer, bridge_url, bridge_test, searches=2)
    print(f"wiki-bridge test oracles: one search EM {one:.3f}, two searches EM {two:.3f}")
    assert one_searches == 1.0 and two_searches == 2.0
    assert two >= 2 * one and two >= 0.3


def test_multi_turn_masks_cover_both_information_blocks(tokenizer, bridge_url, bridge_test):
    from agent_env.generation.scripted import ScriptedGenerator
    from agent_env.retrieval_client import RetrievalClient, RetrievalConfig

    config = RolloutConfig(prompt=MULTI_TURN, max_turns=2, doc_words=8, max_obs_tokens=128)
    policy = ScriptedGenerator(tokenizer, MULTI_TURN, searches=2)
    with RetrievalClient(RetrievalConfig(urls=[bridge_url], topk=3)) as client:
        (group,) = rollout_groups(policy, client, tokenizer, bridge_test[:1], 2, config).groups
    for traj in group:
        env = [i for i, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m == 0]
        env_text = tokenizer.decode(env, skip_special_tokens=False)
        assert env_text.count("<information>") == 2 and "<search>" not in env_text
        assert len(traj.observations) == 2 and traj.answer is not None
