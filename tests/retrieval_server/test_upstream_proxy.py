"""Proxy mode (`hdr serve --upstream URL`) against real servers on 127.0.0.1: a second `hdr
serve`, and tiny servers written here that answer 503 or never answer. The upstream sees each
distinct query once; its failures come back as one-line 502/504; a spent budget refuses
misses with 429 while hits are still served."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import quote, quote_plus

import httpx
import pytest
from fake_upstream import fake_upstream
from servers import http_handler_server, running_server, serve_process

from retrieval_server.config import ServerConfig
from retrieval_server.upstream.config import UpstreamConfig
from retrieval_server.upstream.spend import BudgetSpent, MemoryLedger


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
    upstream_url: str, budget: dict, named: str, tmp_path: Path
) -> None:
    spend = {"spend_path": tmp_path / "spend.json"}
    with running_server(None, upstream={"url": upstream_url, **budget, **spend}) as proxy:
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
    ledger = MemoryLedger(config)

    async def three_then_one() -> None:
        await ledger.reserve(3)
        await ledger.reserve(1)

    with pytest.raises(BudgetSpent, match="leaves 0 calls, this request needs 1"):
        asyncio.run(three_then_one())


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


# --- an upstream that lies, and secrets --------------------------------------------------------


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The one `hdr: error:` line of a failed start (exit 2, no traceback)."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("hdr: error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def serve_upstream(url: str, *settings: str, env: dict | None = None):
    """`hdr serve --upstream URL` expected to stop at start."""
    return subprocess.run(
        [sys.executable, "-m", "hdr.cli", "serve", "--upstream", url, "--port", "0", *settings],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_an_answer_that_is_not_a_search_r1_result_is_a_502_and_never_cached() -> None:
    """Before: `{"result": [[1]]}` was a 200 with that body, and after the upstream was fixed
    the same query still got `[[1]]` from the cache, billed nothing."""
    with (
        fake_upstream(body=b'{"result": [[1]]}') as api,
        running_server(None, upstream={"url": api.url, "max_retries": 0}) as proxy,
    ):
        bad = post(proxy.url, ["Haiku"])
        plain = httpx.post(f"{proxy.url}/retrieve", json={"queries": ["Circus"]}, timeout=30)
        api.body = None  # fixed
        good = post(proxy.url, ["Haiku"])
        health = httpx.get(f"{proxy.url}/health").json()
    assert bad.status_code == 502 and plain.status_code == 502
    assert bad.json()["detail"] == (
        f"upstream {api.url} answered a body that is not a Search-R1 result for 1 queries"
    )
    assert good.status_code == 200 and billed(good) == 1
    assert good.json()["result"][0][0]["document"]["id"] == "Haiku"
    # the upstream answered (and billed) all three; the lie was not kept
    assert health["upstream"]["calls"] == 3 and health["cache"]["entries"] == 1


def test_a_deeply_nested_or_huge_upstream_body_is_a_one_line_502() -> None:
    """Before: a 500 whose body is `[` x 100,000 raised RecursionError in the one-line
    formatter: a 500 of hdr's own. A body past upstream.max_response_bytes is not read on."""
    deep = b"[" * 100_000
    with fake_upstream(status=500, body=deep) as api:
        with running_server(None, upstream={"url": api.url, "max_retries": 0}) as proxy:
            nested = post(proxy.url, ["Haiku"])
        api.status, api.body = 200, b'{"result": [[' + b" " * 10_000 + b"]]}"
        capped = {"url": api.url, "max_retries": 0, "max_response_bytes": 4096}
        with running_server(None, upstream=capped) as proxy:
            huge = post(proxy.url, ["Circus"])
    assert nested.status_code == 502
    detail = nested.json()["detail"]
    assert detail.startswith(f"upstream {api.url}/retrieve answered HTTP 500: [[[[")
    assert len(detail) < 300 and "\n" not in detail
    assert huge.status_code == 502
    assert huge.json()["detail"] == (
        f"upstream {api.url} answered more than 4096 bytes (upstream.max_response_bytes)"
    )


def test_a_bad_health_at_start_is_one_line_and_exit_2() -> None:
    """Before: the same deep body from /health crashed `hdr serve` with a traceback, exit 3."""
    with fake_upstream(health=b"[" * 100_000) as api:
        deep = one_error_line(serve_upstream(api.url))
        api.health = b"not json"
        garbage = one_error_line(serve_upstream(api.url))
    assert deep.startswith(f"hdr: error: upstream {api.url} answered /health with a body that")
    assert "is it a Search-R1 server?" in deep and len(deep) < 400
    assert "not a JSON object (not json)" in garbage


def test_no_secret_of_the_url_or_the_token_is_shown_and_queries_are_kept() -> None:
    """A user and password, an API key in the query string and a token: sent upstream, never
    in the ready line, /health, /metrics or an error (the upstream's detail that echoes the
    key included). Before: the ready line showed the password, and `?api_key=KEY` was joined
    into `POST /v1?api_key=KEY/retrieve` and shown in /health."""
    key, token = "KEY-81d1c0ffee", "TOKEN-5e77a1"
    with fake_upstream(status=503, body=f'{{"detail": "bad key {key}"}}'.encode()) as api:
        port = api.url.rsplit(":", 1)[1]
        with serve_process(
            None, "upstream.max_retries=0", upstream=f"http://alice:s3cret@127.0.0.1:{port}"
        ) as basic:
            shown = [httpx.get(f"{basic.url}/{page}").text for page in ("health", "metrics")]
            shown.append(post(basic.url, ["Haiku"]).text)
        shown.append(basic.output)
        assert all("s3cret" not in text and "alice" not in text for text in shown), shown
        assert api.authorizations[-1].startswith("Basic ")

        keyed = f"http://127.0.0.1:{port}/v1?api_key={key}"
        env = {"HDR_UPSTREAM_TOKEN": token}
        with serve_process(None, "upstream.max_retries=0", upstream=keyed, env=env) as bearer:
            health = httpx.get(f"{bearer.url}/health").json()
            shown = [httpx.get(f"{bearer.url}/metrics").text, json.dumps(health)]
            error = post(bearer.url, ["Haiku"])
            shown.append(error.text)
        shown.append(bearer.output)
        assert all(key not in text and token not in text for text in shown), shown
        assert health["upstream"]["url"] == f"http://127.0.0.1:{port}/v1?api_key=***"
        assert error.json()["detail"] == (
            f"upstream http://127.0.0.1:{port}/v1/retrieve?api_key=*** answered HTTP 503: bad"
            " key ***"
        )
        assert api.paths[-1] == f"/v1/retrieve?api_key={key}"  # joined, the query kept
        assert f"/v1/health?api_key={key}" in api.paths
        assert api.authorizations[-1] == f"Bearer {token}"
        # userinfo and a token together: one would silently replace the other
        both = serve_upstream(f"http://alice:s3cret@127.0.0.1:{port}", env=env)
    line = one_error_line(both)
    assert "carries a user and password and $HDR_UPSTREAM_TOKEN is set too" in line
    assert "s3cret" not in line and token not in line


@pytest.mark.parametrize(
    "changed", [{"default_retriever": "bm25"}, {"max_query_chars": 4}], ids=["retriever", "cut"]
)
def test_a_persisted_proxy_cache_is_not_loaded_after_its_upstream_changed(
    small_index: Path, tmp_path: Path, changed: dict
) -> None:
    """The upstream restarted on the same index and port, with another default retriever or
    query cut: the same fingerprint of its index, other answers. Before: the proxy loaded its
    saved cache and kept serving the old upstream's answers."""
    saved, query = tmp_path / "proxy.cache", ["Japanese poetry form with 17 syllables"]
    proxy_settings = {"cache": {"persist_path": saved}}
    with running_server(small_index, cache={"enabled": False}) as upstream:
        port = int(upstream.url.rsplit(":", 1)[1])
        with running_server(None, upstream={"url": upstream.url}, **proxy_settings) as proxy:
            before = post(proxy.url, query)
    with (
        running_server(small_index, port=port, cache={"enabled": False}, **changed) as upstream,
        running_server(None, upstream={"url": upstream.url}, **proxy_settings) as proxy,
    ):
        loaded = httpx.get(f"{proxy.url}/health").json()["cache"]["loaded"]
        after = post(proxy.url, query)
        direct = post(upstream.url, query)
    assert loaded == 0 and billed(after) == 1
    assert after.json() == direct.json() != before.json()


def test_secrets_echoed_in_encoded_form_are_masked() -> None:
    """An upstream's error detail that echoes the query string's key URL-encoded (upper and
    lower hex, `+` for a space) or the Basic header's base64 of the user and password: every
    form is masked in the 502. Before: only the key as written was, and these went through."""
    key = "k/ey+81 d1"
    basic = base64.b64encode(b"alice:s3cret-pw").decode()
    echoed = [quote(key, safe=""), quote(key, safe="").lower(), quote_plus(key), basic]
    body = json.dumps({"detail": "refused: " + " | ".join(echoed)}).encode()
    with fake_upstream(status=503, body=body) as api:
        port = api.url.rsplit(":", 1)[1]
        url = f"http://alice:s3cret-pw@127.0.0.1:{port}/v1?api_key={quote(key, safe='')}"
        with running_server(None, upstream={"url": url, "max_retries": 0}) as proxy:
            error = post(proxy.url, ["Haiku"])
    assert api.authorizations[-1] == f"Basic {basic}"  # the secrets did reach the upstream
    assert api.paths[-1] == f"/v1/retrieve?api_key={quote(key, safe='')}"
    detail = error.json()["detail"]
    assert error.status_code == 502
    assert detail.endswith("answered HTTP 503: refused: *** | *** | *** | ***"), detail
