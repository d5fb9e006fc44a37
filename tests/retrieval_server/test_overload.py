"""Overload controls of a real server: the HTTP concurrency limit, the server-side deadline and
dropping the work of a client that went away, each visible in /metrics."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from servers import running_server

MANY = [f"Great Wall of China {i}" for i in range(8192)]  # seconds of dense encoding on a CPU


def metric(url: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_until_drained(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(url, "hdr_retrieval_queue_queries") > 0:
        assert time.monotonic() < deadline, "the queue never drained"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def deadline_url(small_index: Path) -> Iterator[str]:
    with running_server(small_index, request_deadline_s=1.0, max_batch_queries=64) as server:
        yield server.url


def test_a_request_past_its_deadline_is_503_and_its_queries_are_dropped(deadline_url) -> None:
    searched = 'hdr_retrieval_queries_total{retriever="dense"}'
    before = metric(deadline_url, searched)
    response = httpx.post(f"{deadline_url}/retrieve", json={"queries": MANY}, timeout=120)
    assert response.status_code == 503
    assert response.json()["detail"] == "not answered within the 1 s deadline"
    assert response.headers["retry-after"] == "1"
    wait_until_drained(deadline_url)
    assert metric(deadline_url, "hdr_retrieval_expired_total") == 1
    assert metric(deadline_url, searched) - before < len(MANY)  # the rest was never searched
    ok = httpx.post(f"{deadline_url}/retrieve", json={"queries": ["Haiku"]}, timeout=60)
    assert ok.status_code == 200


def test_a_client_that_disconnects_stops_its_search(deadline_url) -> None:
    searched = 'hdr_retrieval_queries_total{retriever="dense"}'
    before = metric(deadline_url, searched)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{deadline_url}/retrieve", json={"queries": MANY}, timeout=0.3)
    wait_until_drained(deadline_url)
    deadline = time.monotonic() + 30
    while metric(deadline_url, "hdr_retrieval_disconnected_total") < 1:
        assert time.monotonic() < deadline, "the disconnect was not noticed"
        time.sleep(0.1)
    assert metric(deadline_url, searched) - before < len(MANY)


def test_the_concurrency_limit_refuses_before_reading_and_spares_health(small_index) -> None:
    """One request holds the only slot (its emulated API latency keeps it inside); the next is
    refused at once with 503 + Retry-After; /health and /metrics still answer; once the slot
    frees, it serves."""
    config = {"max_concurrent_requests": 1, "emulated_cost": {"request_latency_ms": 1500}}
    with running_server(small_index, **config) as server:
        holder = threading.Thread(
            target=httpx.post,
            args=(f"{server.url}/retrieve",),
            kwargs={"json": {"queries": ["Haiku"]}, "timeout": 60},
        )
        holder.start()
        deadline = time.monotonic() + 30
        while metric(server.url, "hdr_retrieval_requests_in_flight") < 1:
            assert time.monotonic() < deadline, "the holder never got in"
            time.sleep(0.05)
        busy = httpx.post(f"{server.url}/retrieve", json={"queries": ["Haiku"]}, timeout=30)
        assert busy.status_code == 503
        assert busy.json()["detail"] == "server busy: too many requests; retry"
        assert busy.headers["retry-after"] == "1"
        assert httpx.get(f"{server.url}/health").status_code == 200
        rejected = 'hdr_retrieval_rejected_total{reason="concurrency"}'
        assert metric(server.url, rejected) == 1
        holder.join(timeout=60)  # the held request ends; its slot frees
        again = httpx.post(f"{server.url}/retrieve", json={"queries": ["Haiku"]}, timeout=30)
        assert again.status_code == 200
