"""Bearer-token protection and the health endpoint."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from servers import running_server

TOKEN = "s3cret-token"
BODY = {"queries": ["Batman"], "topk": 1}


@pytest.fixture(scope="module")
def protected_url(small_index: Path) -> Iterator[str]:
    with running_server(small_index, api_token=TOKEN, default_retriever="bm25") as server:
        yield server.url


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": "Basic x"}],
)
def test_retrieve_without_the_right_token_is_401(protected_url: str, headers: dict) -> None:
    response = httpx.post(f"{protected_url}/retrieve", json=BODY, headers=headers)
    assert response.status_code == 401
    assert response.json()["detail"] == "missing or wrong bearer token"
    assert response.headers["www-authenticate"] == "Bearer"


def test_retrieve_and_metrics_with_the_token(protected_url: str) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    response = httpx.post(f"{protected_url}/retrieve", json=BODY, headers=auth)
    assert response.status_code == 200
    assert '"Batman"' in response.json()["result"][0][0]["contents"]
    assert httpx.get(f"{protected_url}/metrics").status_code == 401
    metrics = httpx.get(f"{protected_url}/metrics", headers=auth)
    assert metrics.status_code == 200
    assert 'hdr_retrieval_errors_total{endpoint="/retrieve",status="401"}' in metrics.text
    assert 'hdr_retrieval_queries_total{retriever="bm25"}' in metrics.text


def test_health_is_open_and_describes_the_index(protected_url: str, small_corpus: Path) -> None:
    response = httpx.get(f"{protected_url}/health")
    assert response.status_code == 200
    health = response.json()
    cache = health.pop("cache")
    assert cache["enabled"] is True and cache["max_bytes"] == 256 * 2**20
    assert cache["bytes"] <= cache["max_bytes"] and re.fullmatch(
        "[0-9a-f]{16}", cache["fingerprint"]
    )
    assert health.pop("upstream") is None and health.pop("snapshot") is None
    assert health == {
        "status": "ok",
        "reason": None,
        "documents": len(small_corpus.read_text().splitlines()),
        "encoder": "all-MiniLM-L6-v2",
        "index_type": "Flat",
        "retrievers": ["bm25", "dense"],
        "default_retriever": "bm25",
        "profile": "search-r1",
        "max_query_chars": 2048,
        "emulated_cost": {
            "enabled": False,
            "request_latency_ms": 0.0,
            "query_latency_ms": 0.0,
            "rate_limit_rps": 0.0,
            "requests_charged": 0,
            "seconds_waited": 0.0,
        },
    }
