"""Proxy mode (`hdr serve --upstream URL`) against real servers on 127.0.0.1: a second `hdr
serve`, and tiny servers written here that answer 503 or never answer. The upstream sees each
distinct query once; its failures come back as one-line 502/504; a spent budget refuses
misses with 429 while hits are still served."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest
from servers import http_handler_server, running_server

from retrieval_server.config import ServerConfig
from retrieval_server.upstream import Budget, BudgetSpent, UpstreamConfig, UpstreamCounts


def post(url: str, queries: list[str], **extra: object) -> httpx.Response:
    body = {"queries": queries, "topk": 3, "return_scores": True, **extra}
    return httpx.post(f"{url}/retrieve", json=body, timeout=60)


def billed(response: httpx.Response) -> int:
    return int(response.headers["x-hdr-billed-queries"])


def searched(url: str) -> float:
    """Queries the upstream `hdr serve` has searched in its index."""
    text = httpx.get(f"{url}/metrics").text
    match = re.search(r'hdr_retrieval_queries_total{retriever="dense"} (\S+)', text)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def upstream_url(small_index: Path) -> Iterator[str]:
    """A real `hdr serve` without a cache of its own, so it searches every query it gets."""
    with running_server(small_index, cache={"enabled": False}) as server:
        yield server.url


def test_the_upstream_sees_one_call_per_distinct_query(upstream_url: str) -> None:
    with running_server(None, upstream={"url": upstream_url}) as proxy:
        before = searched(upstream_url)
        first = post(proxy.url, ["Haiku", "Circus", "Haiku"])
        second = post(proxy.url, ["Circus", "Dada"])
        third = post(proxy.url, ["Haiku", "Dada", "Circus"])
        health = httpx.get(f"{proxy.url}/health").json()
        direct = post(upstream_url, ["Haiku", "Dada", "Circus"])
    assert [r.status_code for r in (first, second, third)] == [200, 200, 200]
    assert [billed(r) for r in (first, second, third)] == [2, 1, 0]
    assert searched(upstream_url) - before == 3 + 3  # three distinct via the proxy, three direct
    # the upstream's own answers (scores to the float noise of another batch's composition)
    for proxied, own in zip(third.json()["result"], direct.json()["result"], strict=True):
        assert [hit["document"] for hit in proxied] == [hit["document"] for hit in own]
        assert [h["score"] for h in proxied] == pytest.approx([h["score"] for h in own], abs=1e-4)
    assert health["upstream"]["calls"] == 3 and health["upstream"]["requests"] == 2
    assert health["documents"] == direct_health(upstream_url)["documents"]
    cache = health["cache"]
    assert (cache["hits"], cache["misses"], cache["coalesced"]) == (4, 3, 1)


def direct_health(url: str) -> dict:
    return httpx.get(f"{url}/health").json()


@pytest.mark.parametrize(
    ("budget", "named"),
    [({"max_calls": 2}, "upstream.max_calls 2"),
     ({"price_per_call": 0.5, "max_spend": 1.0}, "upstream.max_spend 1")],
)  # fmt: skip
def test_a_spent_budget_refuses_misses_and_still_serves_hits(
    upstream_url: str, budget: dict, named: str
) -> None:
    with running_server(None, upstream={"url": upstream_url, **budget}) as proxy:
        assert post(proxy.url, ["Haiku"]).status_code == 200
        assert post(proxy.url, ["Circus"]).status_code == 200
        refused = post(proxy.url, ["Dada"])
        mixed = post(proxy.url, ["Haiku", "Dada"])  # one hit, one miss: the miss is refused
        hit = post(proxy.url, ["Circus", "Haiku"])
        upstream = httpx.get(f"{proxy.url}/health").json()["upstream"]
    assert refused.status_code == 429 and mixed.status_code == 429
    detail = refused.json()["detail"]
    assert "\n" not in detail and named in detail and "cached queries are still answered" in detail
    assert hit.status_code == 200 and billed(hit) == 0
    assert upstream["calls"] == 2 and upstream["refused_over_budget"] == 2
    assert upstream["spent"] == 2 * upstream["price_per_call"]


# --- upstreams that fail ---------------------------------------------------------------------


class FailingUpstream(BaseHTTPRequestHandler):
    """GET /health answers 200; POST /retrieve answers 503 with a two-line detail, or (stall)
    reads the request and never answers until the test ends."""

    stall = threading.Event()  # set: answer nothing; the test's end releases the threads
    release = threading.Event()
    posts = 0

    def do_GET(self) -> None:
        self.answer(200, {"status": "ok"})

    def do_POST(self) -> None:
        type(self).posts += 1
        self.rfile.read(int(self.headers["content-length"]))
        if self.stall.is_set():
            self.release.wait(30)
            return
        self.answer(503, {"detail": "upstream overloaded\nsecond line of a stack trace"})

    def answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:  # quiet
        pass


@contextmanager
def failing_upstream(stall: bool) -> Iterator[str]:
    FailingUpstream.posts = 0
    FailingUpstream.release.clear()
    (FailingUpstream.stall.set if stall else FailingUpstream.stall.clear)()
    with http_handler_server(FailingUpstream) as url:
        try:
            yield url
        finally:
            FailingUpstream.release.set()  # a stalled handler returns before the shutdown


def test_an_upstream_503_is_a_one_line_502_after_retries() -> None:
    settings = {"max_retries": 2, "backoff_s": 0.01}
    with (
        failing_upstream(stall=False) as url,
        running_server(None, upstream={"url": url, **settings}) as proxy,
    ):
        response = post(proxy.url, ["Haiku"])
        health = httpx.get(f"{proxy.url}/health").json()
    assert response.status_code == 502
    detail = response.json()["detail"]
    assert detail == (
        f"upstream {url}/retrieve answered HTTP 503: upstream overloaded second line of a stack"
        " trace (3 attempts)"
    )
    assert FailingUpstream.posts == 3
    assert health["upstream"]["failures"] == 1 and health["upstream"]["calls"] == 0
    assert health["cache"]["entries"] == 0  # nothing cached from a failure


def test_a_stalled_upstream_is_a_one_line_504() -> None:
    with (
        failing_upstream(stall=True) as url,
        running_server(
            None, upstream={"url": url, "timeout_s": 0.5, "max_retries": 1, "backoff_s": 0.01}
        ) as proxy,
    ):
        response = post(proxy.url, ["Haiku"])
        upstream = httpx.get(f"{proxy.url}/health").json()["upstream"]
    assert response.status_code == 504
    assert response.json()["detail"] == (
        f"upstream {url}/retrieve did not answer within 0.5 s (2 attempts)"
    )
    assert FailingUpstream.posts == 2 and upstream["retries"] == 1


def test_an_unreachable_upstream_is_refused_at_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    from servers import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    result = subprocess.run(
        [sys.executable, "-m", "hdr.cli", "serve", "--upstream", url, "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"hdr: error: upstream {url} does not answer (ConnectError); start it first or correct"
        " --upstream"
    )


def test_the_spend_budget_counts_whole_calls() -> None:
    """0.3 at 0.1 a call buys three calls (0.1 x 3 is above 0.3 in binary floats); the fourth
    is refused and the message says none is left."""
    config = UpstreamConfig(url="http://127.0.0.1:9", price_per_call=0.1, max_spend=0.3)
    budget = Budget(config, UpstreamCounts())
    budget.reserve(3)
    with pytest.raises(BudgetSpent, match="leaves 0 calls, this request needs 1"):
        budget.reserve(1)


def test_a_forward_that_could_outlast_the_request_deadline_is_refused() -> None:
    """3 attempts of 30 s reach the 60 s request deadline: a stalled upstream would be
    answered by the deadline's 503, so the setting is refused at start, saying why."""
    with pytest.raises(ValueError, match="never in a 504"):
        ServerConfig(upstream={"url": "http://127.0.0.1:9", "timeout_s": 30})
    assert ServerConfig(upstream={"url": "http://127.0.0.1:9"}).upstream.worst_case_s() < 60


def test_the_upstreams_credentials_are_never_shown() -> None:
    """A URL with a user and password is shown (errors, /health) without them."""
    config = UpstreamConfig(url="http://searcher:s3cret@127.0.0.1:9")
    assert config.shown_url == "http://127.0.0.1:9" and "s3cret" not in config.shown_url
