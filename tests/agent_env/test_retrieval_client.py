"""The retrieval client against a real server: batching across URLs, retries, failover."""

from __future__ import annotations

import pytest

from agent_env.retrieval_client import RetrievalClient, RetrievalConfig, RetrievalFailed
from hdr.errors import UserError

QUERIES = ["accordion musical instrument", "Evan Morris lobbyist", "art movement", "Africa"]


def test_batch_is_spread_over_urls_in_order(retrieval_url: str) -> None:
    one = RetrievalConfig(urls=[retrieval_url], topk=2)
    two = RetrievalConfig(urls=[retrieval_url, retrieval_url + "/"], topk=2)
    with RetrievalClient(one) as single, RetrievalClient(two) as double:
        expected = single.search(QUERIES)
        got = double.search(QUERIES)
        assert single.stats.requests == 1
        assert double.stats.requests == 2  # one chunk per URL, sent concurrently
    assert [[d.id for d in docs] for docs in got] == [[d.id for d in docs] for docs in expected]
    assert all(len(docs) == 2 for docs in got)
    assert "Evan Morris" in got[1][0].contents


def test_bm25_and_dense_are_selectable(retrieval_url: str) -> None:
    results = {}
    for name in ("dense", "bm25"):
        config = RetrievalConfig(urls=[retrieval_url], topk=1, retriever=name)
        with RetrievalClient(config) as client:
            results[name] = client.search(["Evan Morris Genentech lobbyist"])[0][0].contents
    assert all(r.startswith('"Evan Morris"') for r in results.values())


def test_dead_server_retries_then_fails(small_index) -> None:
    from servers import running_server

    with running_server(small_index) as server:
        url = server.url
        server.stop()
    config = RetrievalConfig(urls=[url], max_retries=2, backoff_s=0.01, backoff_max_s=0.02)
    with RetrievalClient(config, seed=0) as client:
        with pytest.raises(RetrievalFailed, match="3 attempts"):
            client.search(["anything"])
        assert (client.stats.attempts, client.stats.retries, client.stats.failures) == (3, 2, 1)
        assert client.stats.requests == 0


def test_failover_to_a_live_url(small_index, retrieval_url: str) -> None:
    from servers import running_server

    with running_server(small_index) as server:
        dead = server.url
        server.stop()
    config = RetrievalConfig(urls=[dead, retrieval_url], backoff_s=0.01, max_batch_queries=1)
    with RetrievalClient(config, seed=0) as client:
        results = client.search(QUERIES)
        assert len(results) == 4 and all(results)
        assert client.stats.retries >= 1 and client.stats.failures == 0


def test_a_refused_request_is_a_user_error(retrieval_url: str) -> None:
    config = RetrievalConfig(urls=[retrieval_url], topk=10_000)
    with RetrievalClient(config) as client, pytest.raises(UserError, match="422"):
        client.search(["x"])
