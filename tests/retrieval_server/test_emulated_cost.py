"""Emulated remote-API cost: the configured latency and rate limit show up in measured time,
and only queries that are computed (billed) are charged: a cache hit costs nothing.

The assertions are lower bounds the server enforces (a request cannot answer before its
emulated delay), not speed targets.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from servers import running_server

from core.errors import UserError


def timed_post(url: str, queries: list[str]) -> float:
    started = time.perf_counter()
    response = httpx.post(f"{url}/retrieve", json={"queries": queries, "topk": 1}, timeout=30)
    assert response.status_code == 200
    assert len(response.json()["result"]) == len(queries)
    return time.perf_counter() - started


def test_latency_per_request_and_per_query_is_charged_and_reported(small_index: Path) -> None:
    cost = {"request_latency_ms": 150.0, "query_latency_ms": 40.0}
    with running_server(small_index, default_retriever="bm25", emulated_cost=cost) as server:
        one = timed_post(server.url, ["Batman"])
        five = timed_post(server.url, ["Anime", "Accordion", "Paris", "Rome", "Jazz"])
        mixed = timed_post(server.url, ["Batman", "Anime", "Dada"])  # one billed query
        timed_post(server.url, ["Batman", "Paris"])  # nothing billed: no call, no charge
        health = httpx.get(f"{server.url}/health").json()["emulated_cost"]
    assert one >= 0.150 + 0.040
    assert five >= 0.150 + 5 * 0.040
    assert mixed >= 0.150 + 0.040
    assert health["enabled"] is True
    assert health["request_latency_ms"] == 150.0 and health["query_latency_ms"] == 40.0
    assert health["requests_charged"] == 3  # of four requests: the cached one made no call
    assert health["seconds_waited"] >= 0.150 * 3 + 0.040 * 7


def test_rate_limit_spaces_requests(small_index: Path) -> None:
    with running_server(
        small_index, default_retriever="bm25", emulated_cost={"rate_limit_rps": 10.0}
    ) as server:
        started = time.perf_counter()
        for query in ["Batman", "Anime", "Paris", "Rome", "Jazz", "Dada"]:
            timed_post(server.url, [query])
        elapsed = time.perf_counter() - started
        health = httpx.get(f"{server.url}/health").json()["emulated_cost"]
    # six requests at 10 per second: the last may start no earlier than 0.5 s after the first
    assert elapsed >= 0.5
    assert health["requests_charged"] == 6 and health["rate_limit_rps"] == 10.0


def test_emulated_cost_is_off_by_default_and_validated(small_index: Path) -> None:
    from core.config import load_config
    from retrieval_server.config import ServerConfig

    config = load_config(ServerConfig, None, [f"index_dir={small_index}"])
    assert not config.emulated_cost.enabled
    set_config = load_config(
        ServerConfig, None, [f"index_dir={small_index}", "emulated_cost.query_latency_ms=25"]
    )
    assert set_config.emulated_cost.enabled and set_config.emulated_cost.delay_s(4) == 0.1
    try:
        load_config(ServerConfig, None, [f"index_dir={small_index}", "emulated_cost.bogus=1"])
    except UserError as err:
        assert "bogus" in str(err)
    else:
        raise AssertionError("an unknown emulated_cost key was accepted")
