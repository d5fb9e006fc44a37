"""A search thread that hangs, against a real server: once the running search is older than
`search_stall_s`, `/health` answers 503 with the reason (so Docker's HEALTHCHECK or another
supervisor restarts the server), and it answers 200 again if the search comes back.

`HangingRetriever` is BM25 underneath, registered like the real retrievers; a query containing
"hang" blocks its search thread until the test releases it.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from retrieval_server.serving.retrievers import RETRIEVERS, BM25Retriever

WAIT_S = 30  # a state the server should reach, not reached by then, fails the test
RELEASE = threading.Event()


class HangingRetriever(BM25Retriever):
    def search(self, queries: list[str], topk: int):
        if any("hang" in query for query in queries):
            RELEASE.wait(timeout=120)  # bounded, so a failing test cannot hang the suite
        return super().search(queries, topk)


@pytest.fixture
def hanging_url(small_index: Path) -> Iterator[str]:
    from servers import running_server

    RETRIEVERS.register("hanging")(HangingRetriever)
    RELEASE.clear()
    try:
        config = {"default_retriever": "hanging", "search_stall_s": 0.5}
        with running_server(small_index, **config) as server:
            try:
                yield server.url
            finally:
                RELEASE.set()  # the server's shutdown waits for its search thread
    finally:
        RETRIEVERS.unregister("hanging")


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


def metric(url: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics").text, re.MULTILINE)
    return float(match.group(1))


def test_a_hung_search_turns_health_503_until_it_returns(hanging_url: str) -> None:
    assert health(hanging_url).json()["status"] == "ok"
    answers: list[httpx.Response] = []
    hung = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{hanging_url}/retrieve", json={"queries": ["hang Haiku"]}, timeout=60)
        )
    )
    hung.start()
    deadline = time.monotonic() + WAIT_S
    while (answer := health(hanging_url)).status_code == 200:
        assert time.monotonic() < deadline, "/health stayed 200 while the search hung"
        time.sleep(0.05)
    assert answer.status_code == 503
    assert answer.json()["status"] == "unhealthy"
    reason = answer.json()["reason"]
    assert re.fullmatch(
        r"a search has not returned for \d+ s \(search_stall_s 0\.5\); "
        r"the search thread looks hung",
        reason,
    ), reason
    assert metric(hanging_url, "hdr_retrieval_healthy") == 0
    assert metric(hanging_url, "hdr_retrieval_search_running_seconds") > 0.5

    RELEASE.set()
    hung.join(timeout=WAIT_S)
    assert answers[0].status_code == 200  # the search came back and was answered
    recovered = health(hanging_url)
    assert recovered.status_code == 200
    assert recovered.json()["status"] == "ok" and recovered.json()["reason"] is None
    assert metric(hanging_url, "hdr_retrieval_search_running_seconds") == 0
