"""Concurrent clients, micro-batching, restarts and stopping a server mid-use."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from servers import running_server

from retrieval_server.index.corpus import split_contents

# 32 distinct vital articles of the small corpus; each title is its own client's query.
TITLES = [
    "Acropolis of Athens", "Adventures of Huckleberry Finn", "Analects", "Anime", "Art Deco",
    "Batman", "Belly dance", "British Museum", "Brandenburg Concertos", "Candide", "Carmen",
    "Cave painting", "Christ the Redeemer (statue)", "Cinderella", "Circus",
    "Crime and Punishment", "Dada", "Der Ring des Nibelungen", "Divine Comedy", "Double bass",
    "Dream of the Red Chamber", "Egyptian Museum", "Euclid's Elements", "Flamenco",
    "Gothic architecture", "Great Wall of China", "Guitar", "Haiku", "Heart of Darkness",
    "Hermitage Museum", "Robin Hood", "The Importance of Being Earnest",
]  # fmt: skip
CLIENTS = len(TITLES)


def retrieve(client: httpx.Client, query: str, **extra: object) -> list[dict]:
    response = client.post("/retrieve", json={"queries": [query], "return_scores": True, **extra})
    assert response.status_code == 200, response.text
    return response.json()["result"][0]


def batch_stats(metrics_text: str, retriever: str) -> tuple[float, float]:
    """(number of searches, number of queries) from the batch-size histogram."""
    values = {}
    for kind in ("count", "sum"):
        pattern = rf'hdr_retrieval_batch_queries_{kind}{{retriever="{retriever}"}} (\S+)'
        values[kind] = float(re.search(pattern, metrics_text).group(1))
    return values["count"], values["sum"]


@pytest.fixture(scope="module")
def batching_url(small_index: Path) -> Iterator[str]:
    """A server whose first request waits up to 100 ms for company before searching; without
    the result cache, so every request is searched (tests/retrieval_server/test_search_cache.py
    tests the cache)."""
    with running_server(small_index, batch_wait_ms=100, cache={"enabled": False}) as server:
        yield server.url


async def concurrent_clients(url: str, queries: list[str]) -> list[list[dict]]:
    """One client per query, all at once; each sends one request with one query."""

    async def one_client(query: str) -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            body = {"queries": [query], "return_scores": True}
            response = await client.post("/retrieve", json=body)
            assert response.status_code == 200, response.text
            return response.json()["result"][0]

    return await asyncio.gather(*(one_client(query) for query in queries))


def test_32_concurrent_clients_each_get_their_own_answer(batching_url: str) -> None:
    with httpx.Client(base_url=batching_url, timeout=120) as client:
        alone = [retrieve(client, title) for title in TITLES]  # one request at a time
        searches_before, queries_before = batch_stats(client.get("/metrics").text, "dense")

    together = asyncio.run(concurrent_clients(batching_url, TITLES))

    for title, own, reference in zip(TITLES, together, alone, strict=True):
        assert split_contents(own[0]["document"]["contents"])[0] == title
        assert [hit["document"] for hit in own] == [hit["document"] for hit in reference]
        assert [hit["score"] for hit in own] == pytest.approx(
            [hit["score"] for hit in reference], abs=1e-4
        )  # batch padding may move the last float bits
    with httpx.Client(base_url=batching_url) as client:
        searches_after, queries_after = batch_stats(client.get("/metrics").text, "dense")
    assert queries_after - queries_before == CLIENTS
    assert searches_after - searches_before < CLIENTS  # some requests were searched together


def test_one_request_with_many_queries_keeps_their_order(batching_url: str) -> None:
    body = {"queries": TITLES[::-1], "topk": 1, "retriever": "dense"}
    response = httpx.post(f"{batching_url}/retrieve", json=body, timeout=60)
    assert response.status_code == 200
    found = [split_contents(hits[0]["contents"])[0] for hits in response.json()["result"]]
    assert found == TITLES[::-1]


def test_requests_larger_than_a_batch_are_served_whole(small_index: Path) -> None:
    with running_server(small_index, max_batch_queries=4) as server:
        body = {"queries": TITLES[:10], "topk": 2}
        response = httpx.post(f"{server.url}/retrieve", json=body, timeout=60)
        assert response.status_code == 200
        result = response.json()["result"]
        assert [split_contents(hits[0]["contents"])[0] for hits in result] == TITLES[:10]


RESTART_REQUESTS = [
    {"queries": TITLES[:8], "topk": 5, "return_scores": True},
    {"queries": ["seventeenth century painting", "a novel about a murder"], "topk": 10},
    {"queries": TITLES[8:16], "topk": 5, "return_scores": True, "retriever": "bm25"},
]


def test_restarted_server_returns_identical_results(small_index: Path) -> None:
    answers = []
    for _ in range(2):
        with running_server(small_index) as server, httpx.Client(base_url=server.url) as client:
            responses = [client.post("/retrieve", json=b, timeout=60) for b in RESTART_REQUESTS]
            answers.append([response.json() for response in responses])
    first, second = answers
    assert all("result" in answer for answer in first)
    assert first == second


def test_stopped_server_refuses_connections(small_index: Path) -> None:
    with running_server(small_index) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        server.stop()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=5)
        server.stop()  # idempotent; the context exit stops it again
