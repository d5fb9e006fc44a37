"""A failing retriever, registered like the real ones: one bad request fails alone, a crashed
batch worker restarts, and past its restart budget the server reports itself unhealthy (503)
instead of leaving requests hanging.

`FlakyRetriever` is BM25 underneath; a query containing "poison" makes its search raise a
ValueError (a bad request), one containing "crash" raises a BaseException subclass, which
escapes the per-batch handling and kills the worker loop.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from retrieval_server.index.corpus import split_contents
from retrieval_server.serving.retrievers import RETRIEVERS, BM25Retriever

TIMEOUT_S = 60  # a request that hangs fails the test by this timeout


class WorkerCrash(BaseException):
    """Not an Exception: what `except Exception` in a worker would let through."""


class FlakyRetriever(BM25Retriever):
    def search(self, queries: list[str], topk: int):
        if any("crash" in query for query in queries):
            raise WorkerCrash("injected")
        if any("poison" in query for query in queries):
            raise ValueError("injected")
        return super().search(queries, topk)


@pytest.fixture(scope="module")
def flaky_url(small_index: Path) -> Iterator[str]:
    from servers import running_server

    RETRIEVERS.register("flaky")(FlakyRetriever)
    try:
        config = {"default_retriever": "flaky", "batch_wait_ms": 300, "worker_max_restarts": 2}
        with running_server(small_index, **config) as server:
            yield server.url
    finally:
        RETRIEVERS.unregister("flaky")


def counter(url: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics").text, re.MULTILINE)
    return float(match.group(1))


async def send_together(url: str, queries: list[str]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
        return await asyncio.gather(
            *(client.post("/retrieve", json={"queries": [query], "topk": 1}) for query in queries)
        )


def test_one_bad_request_in_a_batch_fails_alone(flaky_url: str) -> None:
    queries = ["Batman", "Haiku poison", "Flamenco", "Great Wall of China"]
    responses = asyncio.run(send_together(flaky_url, queries))
    statuses = [response.status_code for response in responses]
    assert statuses == [200, 503, 200, 200]
    assert responses[1].json()["detail"] == "search failed: ValueError; retry"
    assert responses[1].headers["retry-after"] == "1"
    for query, response in zip(queries, responses, strict=True):
        if response.status_code == 200:
            title = split_contents(response.json()["result"][0][0]["contents"])[0]
            assert title == query
    assert counter(flaky_url, "hdr_retrieval_failed_searches_total") == 1
    # searched together first (one batch), then each request alone after the failure
    assert counter(flaky_url, 'hdr_retrieval_batch_queries_count{retriever="flaky"}') == 5


def test_a_crashed_worker_restarts_then_gives_up_and_turns_unhealthy(flaky_url: str) -> None:
    crash = httpx.post(f"{flaky_url}/retrieve", json={"queries": ["crash"]}, timeout=TIMEOUT_S)
    assert crash.status_code == 503
    assert crash.json()["detail"] == "search failed: WorkerCrash; retry"
    after = httpx.post(f"{flaky_url}/retrieve", json={"queries": ["Batman"]}, timeout=TIMEOUT_S)
    assert after.status_code == 200  # the loop restarted
    assert httpx.get(f"{flaky_url}/health").json()["status"] == "ok"
    assert counter(flaky_url, "hdr_retrieval_worker_restarts_total") == 1

    for _ in range(2):  # worker_max_restarts = 2: the third crash within a minute is one too many
        response = httpx.post(f"{flaky_url}/retrieve", json={"queries": ["crash"]}, timeout=30)
        assert response.status_code == 503
    health = httpx.get(f"{flaky_url}/health")
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    refused = httpx.post(f"{flaky_url}/retrieve", json={"queries": ["Accordion"]}, timeout=30)
    assert refused.status_code == 503
    assert refused.json()["detail"] == "server unhealthy; retry later"
    # an answer already cached needs no search: still served
    cached = httpx.post(f"{flaky_url}/retrieve", json={"queries": ["Batman"]}, timeout=30)
    assert cached.status_code == 200 and cached.headers["x-hdr-cached-queries"] == "1"
    metrics = httpx.get(f"{flaky_url}/metrics").text
    assert "hdr_retrieval_healthy 0.0" in metrics
    assert 'hdr_retrieval_rejected_total{reason="unhealthy"} 1.0' in metrics
