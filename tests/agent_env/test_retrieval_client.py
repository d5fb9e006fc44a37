"""The retrieval client against a real server: batching across URLs, retries, failover, the
circuit breaker, the outage grace, per-chunk failures; and against a minimal server written
here that implements only Search-R1's contract."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest
from servers import http_handler_server

from agent_env.retrieval_client import (
    RetrievalClient,
    RetrievalConfig,
    RetrievalFailed,
    RetrievalUnavailable,
)
from core.errors import UserError
from retrieval_server.config import ServerConfig

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


def test_billed_and_cached_queries_are_counted_from_the_servers_ledger(
    retrieval_url: str,
) -> None:
    # queries no other test sends, so the session server's cache has not seen them
    first = ["ledger: bowed string instrument", "ledger: dance of Andalusia"]
    config = RetrievalConfig(urls=[retrieval_url], topk=2, max_batch_queries=2)
    with RetrievalClient(config) as client:
        client.search([first[0], first[1], first[0]])  # two chunks: [a, b], [a]
        assert client.stats.queries == 3
        assert client.stats.billed_queries + client.stats.cached_queries == 3
        assert client.stats.billed_queries == 2  # `a` is computed once, wherever it went
        client.search([first[1], "ledger: a third question"])
        assert (client.stats.billed_queries, client.stats.cached_queries) == (3, 2)


def test_dead_server_retries_then_waits_out_the_grace_then_stops(small_index) -> None:
    from servers import running_server

    with running_server(small_index) as server:
        url = server.url
        server.stop()
    config = RetrievalConfig(
        urls=[url], max_retries=2, backoff_s=0.01, backoff_max_s=0.02, outage_grace_s=0.5
    )
    with RetrievalClient(config, seed=0) as client:
        with pytest.raises(RetrievalUnavailable, match=r"for 0.5 s \(retrieval.outage_grace_s\)"):
            client.search(["anything"])
        assert (client.stats.attempts, client.stats.retries) == (3, 2)
        assert client.stats.outages == 1 and client.stats.outage_s >= 0.5
        assert client.stats.requests == 0
    assert issubclass(RetrievalUnavailable, UserError)  # one line, the run stops


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


def test_keep_alive_is_shorter_than_the_servers() -> None:
    assert RetrievalConfig().keepalive_s < ServerConfig(index_dir=".").keep_alive_s


def test_a_dead_url_is_skipped_while_its_breaker_is_open(small_index, retrieval_url) -> None:
    from servers import running_server

    with running_server(small_index) as server:
        dead = server.url
        server.stop()
    config = RetrievalConfig(
        urls=[dead, retrieval_url], backoff_s=0.01, max_batch_queries=1, breaker_s=60
    )
    with RetrievalClient(config, seed=0) as client:
        assert all(client.search(QUERIES))
        retries_first = client.stats.retries
        assert 1 <= retries_first <= 2  # the concurrent chunks sent to the dead URL
        assert all(client.search(QUERIES))  # every chunk goes to the live URL now
        assert client.stats.retries == retries_first
        assert client.stats.requests == 8


# --- a minimal server that implements only Search-R1's contract -------------------------

SEARCH_R1_DOCS = [
    {"title": "Paris", "text": "Paris is the capital of France."},
    {"title": "Lima", "text": "Lima is the capital of Peru."},
    {"title": "Haiku", "text": "Haiku is a short form of Japanese poetry."},
    {"title": "Guitar", "text": "The guitar is a stringed instrument."},
]


def words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


class SearchR1ContractHandler(BaseHTTPRequestHandler):
    """POST /retrieve as Search-R1's server answers it: `{"result": [[{"document", "score"}]]}`
    with scores always (its `return_scores: false` path is broken: answered 500 here),
    documents with `title`, `text`, `contents` and no `id`, `topk` null or 0 = 3. No /health.

    Test hooks: a query with "boom" is answered 500, one with "garble" gets a 200 that is not
    JSON, one with "trickle" gets a valid answer sent one byte every 50 ms."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        queries = request["queries"]
        if not request.get("return_scores") or any("boom" in q for q in queries):
            return self.reply(500, b"Internal Server Error")
        if any("garble" in q for q in queries):
            return self.reply(200, b"<html>proxy error</html>")
        topk = request.get("topk") or 3
        result = []
        for query in queries:
            overlap = {d["title"]: len(words(query) & words(d["text"])) for d in SEARCH_R1_DOCS}
            ranked = sorted(SEARCH_R1_DOCS, key=lambda d: -overlap[d["title"]])
            result.append(
                [
                    {
                        "document": {**doc, "contents": f'"{doc["title"]}"\n{doc["text"]}'},
                        "score": float(overlap[doc["title"]]),
                    }
                    for doc in ranked[:topk]
                ]
            )
        self.reply(200, json.dumps({"result": result}).encode(), trickle="trickle" in str(queries))

    def reply(self, status: int, body: bytes, trickle: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not trickle:
            self.wfile.write(body)
            return
        for i in range(len(body)):
            self.wfile.write(body[i : i + 1])
            self.wfile.flush()
            time.sleep(0.05)


@pytest.fixture(scope="module")
def search_r1_url() -> Iterator[str]:
    with http_handler_server(SearchR1ContractHandler) as url:
        yield url


def test_client_works_against_a_search_r1_contract_server(search_r1_url: str) -> None:
    config = RetrievalConfig(urls=[search_r1_url], topk=2)
    with RetrievalClient(config) as client:
        results = client.search(["capital of Peru", "Japanese poetry"])
    assert [[doc.contents.split("\n")[0] for doc in docs] for docs in results] == [
        ['"Lima"', '"Paris"'],
        ['"Haiku"', '"Paris"'],
    ]
    assert all(doc.id is None for docs in results for doc in docs)
    assert results[0][0].model_extra == {"title": "Lima", "text": "Lima is the capital of Peru."}
    # a server without hdr's ledger headers computed every query: all billed
    assert (client.stats.billed_queries, client.stats.cached_queries) == (2, 0)


def test_one_failing_chunk_does_not_discard_the_others(search_r1_url: str) -> None:
    """Chunks of one query: a 5xx chunk (retries run out while the server is up) and a garbled
    200 fail alone; the other chunks of the turn keep their documents."""
    queries = ["capital of Peru", "boom", "Japanese poetry", "garble"]
    config = RetrievalConfig(
        urls=[search_r1_url], max_batch_queries=1, max_retries=1, backoff_s=0.01
    )
    with RetrievalClient(config, seed=0) as client:
        results = client.search_each(queries)
        assert client.stats.failures == 1 and client.stats.bad_responses == 1
        assert client.stats.failed_queries == 2 and client.stats.outages == 0
        with pytest.raises(RetrievalFailed, match="2 of 4 queries"):
            client.search(queries)
    assert results[1] is None and results[3] is None
    assert results[0][0].contents.startswith('"Lima"')
    assert results[2][0].contents.startswith('"Haiku"')


def test_an_attempt_has_a_total_deadline_not_only_a_read_timeout(search_r1_url: str) -> None:
    """The answer trickles in a byte every 50 ms: no single read waits 1 s, but the attempt
    as a whole passes its 1 s deadline, so it fails instead of hanging on."""
    config = RetrievalConfig(urls=[search_r1_url], timeout_s=1.0, max_retries=0)
    with RetrievalClient(config) as client:
        assert client.search_each(["trickle"]) == [None]
        assert client.stats.failures == 1 and client.stats.requests == 0
        assert client.search_each(["capital of Peru"])[0] is not None  # the pool still works


def test_hash_routing_sends_each_query_to_one_replica_whatever_the_call(
    small_index, retrieval_url: str
) -> None:
    """Two replicas with caches of their own, the same twelve queries sent in three calls of
    different orders and sizes: with rendezvous routing each query is computed by one replica
    only (12 misses in all) and every answer is in its place; rotation computes some of them
    on both."""
    import httpx
    from servers import running_server

    def misses(url: str) -> int:
        return httpx.get(f"{url}/health").json()["cache"]["misses"]

    def calls(tag: str) -> list[list[str]]:
        queries = [f"{tag} {i}: {q}" for i in range(3) for q in QUERIES]
        return [queries, queries[::-1], queries[3:9]]

    with running_server(small_index) as other:
        urls = [retrieval_url, other.url]
        for routing, computed in (("hash", 12), ("rotate", None)):
            before = sum(misses(url) for url in urls)
            config = RetrievalConfig(urls=urls, topk=2, routing=routing)
            with RetrievalClient(config) as client:
                got = [client.search(queries) for queries in calls(f"routing {routing}")]
            spent = sum(misses(url) for url in urls) - before
            if computed is not None:
                assert spent == computed, routing
            else:
                assert spent > 12, "rotation computes some queries on both replicas"
            # every answer in its place: what one server answers for the same calls
            with RetrievalClient(RetrievalConfig(urls=[other.url], topk=2)) as alone:
                for queries, answers in zip(calls(f"routing {routing}"), got, strict=True):
                    assert [[d.id for d in docs] for docs in answers] == [
                        [d.id for d in docs] for docs in alone.search(queries)
                    ]


def test_hash_routing_fails_over_to_the_next_url(small_index, retrieval_url: str) -> None:
    from servers import running_server

    with running_server(small_index) as server:
        dead = server.url
        server.stop()
    config = RetrievalConfig(urls=[dead, retrieval_url], backoff_s=0.01, routing="hash")
    with RetrievalClient(config, seed=0) as client:
        results = client.search([f"failover {q}" for q in QUERIES])
        assert len(results) == 4 and all(results)
        assert client.stats.failures == 0


def test_rendezvous_moves_only_the_queries_of_a_url_that_goes() -> None:
    from agent_env.retrieval_client import rendezvous

    urls = [f"http://replica-{i}:8000" for i in range(4)]
    queries = [f"query {i}" for i in range(2000)]
    owners = {q: urls[rendezvous(urls, q)[0]] for q in queries}
    shares = [sum(owner == url for owner in owners.values()) for url in urls]
    assert min(shares) > 400  # about a quarter each
    fewer = urls[:2] + urls[3:]  # replica-2 goes
    moved = [q for q in queries if fewer[rendezvous(fewer, q)[0]] != owners[q]]
    assert moved and all(owners[q] == urls[2] for q in moved)
    assert len(moved) == shares[2]


def test_settings_recorded_before_routing_existed_compare_as_rotate() -> None:
    """Runs recorded before `routing` existed routed in rotation: their recorded settings,
    which lack the key, read as today's default (trainer.config.history.ADDED_KEYS), so they
    are still reused; a hashing config keeps its routing through a dump."""
    from core.config import fill_added
    from trainer.config.history import ADDED_KEYS

    today = {"retrieval": RetrievalConfig().model_dump(mode="json")}
    recorded = {"retrieval": {k: v for k, v in today["retrieval"].items() if k != "routing"}}
    assert fill_added(recorded, ADDED_KEYS) == today
    dumped = RetrievalConfig(routing="hash").model_dump(mode="json")
    assert RetrievalConfig.model_validate(dumped).routing == "hash"
