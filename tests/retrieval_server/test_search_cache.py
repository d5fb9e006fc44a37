"""The result cache of a real server: a repeated query is a hit with the identical bytes; what
decides an answer (topk, retriever, return_scores, the index and its answer-deciding settings)
is part of the key; the byte bound holds; identical queries (in one request, or concurrent)
are computed once; a persisted cache is loaded only by a server of the same index."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from servers import running_server

from retrieval_server.serving.answers import Answers
from retrieval_server.serving.cache import FILE_MAGIC, CacheKey, ResultCache, entry_bytes


def post(url: str, queries: list[str], **extra: object) -> httpx.Response:
    body = {"queries": queries, "return_scores": True, **extra}
    response = httpx.post(f"{url}/retrieve", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


def ledger(response: httpx.Response) -> tuple[int, int]:
    """(billed, cached) queries, from the response's headers."""
    headers = response.headers
    return int(headers["x-hdr-billed-queries"]), int(headers["x-hdr-cached-queries"])


def cache_health(url: str) -> dict:
    return httpx.get(f"{url}/health").json()["cache"]


def searched_queries(url: str, retriever: str = "dense") -> float:
    """Queries the batcher has searched (its batch-size histogram's sum)."""
    text = httpx.get(f"{url}/metrics").text
    pattern = rf'hdr_retrieval_batch_queries_sum{{retriever="{retriever}"}} (\S+)'
    match = re.search(pattern, text)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def cached_url(small_index: Path) -> Iterator[str]:
    with running_server(small_index) as server:
        yield server.url


def test_a_repeated_query_is_a_hit_with_the_identical_bytes(
    cached_url: str, small_index: Path
) -> None:
    first = post(cached_url, ["Japanese poetry form with 17 syllables"])
    again = post(cached_url, ["Japanese poetry form with 17 syllables"])
    assert ledger(first) == (1, 0)
    assert ledger(again) == (0, 1)
    assert again.content == first.content
    # and it is what a server without a cache computes for the same query
    with running_server(small_index, cache={"enabled": False}) as uncached:
        computed = post(uncached.url, ["Japanese poetry form with 17 syllables"])
        assert ledger(computed) == (1, 0)
        assert cache_health(uncached.url)["enabled"] is False
    assert computed.content == first.content


def test_topk_retriever_return_scores_are_part_of_the_key(cached_url: str) -> None:
    query = ["Bat-themed comic book superhero"]
    base = post(cached_url, query, topk=3)
    assert ledger(base) == (1, 0)
    assert ledger(post(cached_url, query, topk=3)) == (0, 1)
    assert ledger(post(cached_url, query, topk=5)) == (1, 0)
    assert ledger(post(cached_url, query, topk=3, retriever="bm25")) == (1, 0)
    plain = post(cached_url, query, topk=3, return_scores=False)
    assert ledger(plain) == (1, 0)
    assert plain.json()["result"][0] == [hit["document"] for hit in base.json()["result"][0]]


def test_a_scope_has_a_cache_of_its_own(cached_url: str) -> None:
    """A client that names a scope (a training run) is answered only from its scope's answers:
    its own repeats are cached, another scope's or the shared cache's are not."""
    query = ["Spanish dance with guitar and clapping"]

    def scoped(name: str | None) -> tuple[int, int]:
        headers = {} if name is None else {"X-HDR-Cache-Scope": name}
        body = {"queries": query, "return_scores": True}
        response = httpx.post(f"{cached_url}/retrieve", json=body, headers=headers, timeout=60)
        assert response.status_code == 200
        return ledger(response)

    assert scoped("run A") == (1, 0)
    assert scoped("run A") == (0, 1)
    assert scoped("run B") == (1, 0)
    assert scoped(None) == (1, 0)
    assert scoped(None) == (0, 1)
    # two long names that agree in their first 200 characters are two scopes, not one
    long = "train:" + "/runs" * 60
    assert scoped(long + "/arm-a") == (1, 0)
    assert scoped(long + "/arm-b") == (1, 0)
    assert scoped(long + "/arm-a") == (0, 1)


def test_the_key_is_the_query_as_searched_after_truncation(cached_url: str) -> None:
    """The search-r1 profile cuts queries to max_query_chars (2,048): two queries that differ
    only past it are one search."""
    head = "Ancient Greek citadel above Athens " * 60  # 2,100 characters
    first = post(cached_url, [head[:2048] + "one tail"])
    second = post(cached_url, [head[:2048] + "another tail"])
    assert ledger(first) == (1, 0) and ledger(second) == (0, 1)
    assert second.content == first.content


def test_duplicates_inside_one_request_are_computed_once(cached_url: str) -> None:
    before = searched_queries(cached_url)
    queries = ["Wooden stringed instrument", "Circus", "Wooden stringed instrument", "Circus"]
    response = post(cached_url, queries)
    assert ledger(response) == (2, 2)
    assert searched_queries(cached_url) - before == 2
    result = response.json()["result"]
    assert result[0] == result[2] and result[1] == result[3] and result[0] != result[1]


def test_concurrent_identical_requests_make_one_computation(small_index: Path) -> None:
    """Twelve clients send the same query at once while its computation (with an emulated API
    latency of 400 ms) is in flight: one computes, eleven wait on it."""
    clients = 12
    cost = {"request_latency_ms": 400.0}
    with running_server(small_index, emulated_cost=cost) as server:

        async def one_client(client: httpx.AsyncClient) -> httpx.Response:
            return await client.post("/retrieve", json={"queries": ["Flamenco"], "topk": 3})

        async def all_at_once() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                return await asyncio.gather(*(one_client(client) for _ in range(clients)))

        responses = asyncio.run(all_at_once())
        health = httpx.get(f"{server.url}/health").json()
        searched = searched_queries(server.url)
    assert all(response.status_code == 200 for response in responses)
    assert len({response.content for response in responses}) == 1
    assert sorted(ledger(response) for response in responses) == [(0, 1)] * 11 + [(1, 0)]
    assert health["cache"]["misses"] == 1 and health["cache"]["coalesced"] == clients - 1
    assert searched == 1
    assert health["emulated_cost"]["requests_charged"] == 1  # hits and waiters pay nothing


def test_the_cache_stays_within_its_byte_bound(small_index: Path) -> None:
    bound = 24_000  # a handful of answers of three passages
    titles = [f"Music of the century number {i}" for i in range(40)]
    with running_server(small_index, default_retriever="bm25", cache={"max_bytes": bound}) as s:
        for title in titles:
            post(s.url, [title])
            assert cache_health(s.url)["bytes"] <= bound
        health = cache_health(s.url)
        assert ledger(post(s.url, [titles[-1]])) == (0, 1)  # the newest is still held
        assert ledger(post(s.url, [titles[0]])) == (1, 0)  # the oldest was evicted
    assert 0 < health["entries"] < len(titles)
    assert health["evictions"] == len(titles) - health["entries"]
    assert health["max_bytes"] == bound and health["bytes"] > bound // 2


def test_a_persisted_cache_is_loaded_by_the_same_index_only(
    small_index: Path, tmp_path: Path
) -> None:
    from retrieval_server.index.build import build_index

    saved = tmp_path / "answers.cache"
    query = ["Epic poem by Dante"]
    with running_server(small_index, cache={"persist_path": saved}) as server:
        computed = post(server.url, query)
    assert saved.read_bytes().startswith(FILE_MAGIC)
    with running_server(small_index, cache={"persist_path": saved}) as server:
        assert cache_health(server.url)["loaded"] == 1
        again = post(server.url, query)
    assert ledger(again) == (0, 1) and again.content == computed.content
    # a setting that changes answers (the query prefix) is another fingerprint: not loaded
    with running_server(small_index, query_prefix="query: ", cache={"persist_path": saved}) as s:
        assert cache_health(s.url)["loaded"] == 0
        assert ledger(post(s.url, query)) == (1, 0)
    # ... and it kept the file: the first settings find their answers again
    with running_server(small_index, cache={"persist_path": saved}) as server:
        assert cache_health(server.url)["loaded"] == 1
    # another index (here a BM25 index of ten passages) never serves the saved answers
    corpus = tmp_path / "ten.jsonl"
    corpus.write_text(
        "".join(
            f'{{"id": "{i}", "contents": "\\"Dante {i}\\"\\nEpic poem number {i}"}}\n'
            for i in range(10)
        )
    )
    other = tmp_path / "other-index"
    build_index(corpus, other, dense=False, bm25=True, show_progress=False)
    with running_server(other, cache={"persist_path": saved}) as server:
        assert cache_health(server.url)["loaded"] == 0
        fresh = post(server.url, query)
    assert ledger(fresh) == (1, 0) and fresh.content != computed.content


def test_a_persist_path_that_is_not_a_cache_file_is_refused_and_kept(
    small_index: Path, tmp_path: Path
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    line = serve_and_fail(small_index, f"cache.persist_path={notes}")
    assert "is not an hdr search cache" in line
    assert notes.read_text() == "my notes\n"


def test_the_query_log_holds_each_request_and_its_ledger(small_index: Path, tmp_path: Path) -> None:
    log = tmp_path / "queries.jsonl"
    with running_server(small_index, default_retriever="bm25", query_log=log) as server:
        post(server.url, ["Guitar", "Flamenco", "Guitar"], topk=2)
        post(server.url, ["Flamenco"], topk=2)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["queries"], r["billed"], r["cached"]) for r in lines] == [
        (["Guitar", "Flamenco", "Guitar"], 2, 1),
        (["Flamenco"], 0, 1),
    ]
    assert all(r["scope"] == "" for r in lines)
    assert all(r["retriever"] == "bm25" and r["topk"] == 2 and r["return_scores"] for r in lines)
    # an existing file is never written to: `hdr serve` stops in one line
    line = serve_and_fail(small_index, f"query_log={log}")
    assert "query_log" in line and "exists" in line, line
    assert len(log.read_text().splitlines()) == 2


def serve_and_fail(index: Path, *settings: str) -> str:
    """`hdr serve` with `settings` that must fail at start: its one `hdr: error:` line."""
    result = subprocess.run(
        [sys.executable, "-m", "hdr.cli", "serve", "--index", str(index), "--port", "0",
         *settings],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("hdr: error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


# --- the cache itself (no server) ------------------------------------------------------------


def test_least_recently_used_answers_leave_first() -> None:
    def key(i: int) -> CacheKey:
        return CacheKey("", "dense", 3, True, f"query {i}")

    value = b'[{"document":{"id":"1","contents":"x"},"score":0.5}]'
    three = ResultCache(max_bytes=1 << 20, fingerprint="f")
    for i in range(3):
        three.put(key(i), value)
    cache = ResultCache(max_bytes=three.bytes, fingerprint="f")  # room for three entries
    for i in range(3):
        cache.put(key(i), value)
    assert cache.get(key(0)) == value  # now the most recently used
    cache.put(key(3), value)
    assert cache.get(key(1)) is None and cache.get(key(0)) == value
    assert len(cache) == 3 and cache.stats.evictions == 1
    assert cache.bytes == three.bytes
    assert cache.entries_bytes == 3 * entry_bytes(key(0), value) + sys.getsizeof("")
    huge = b"[" + b"0," * 10_000 + b"0]"
    cache.put(key(9), huge)  # larger than the whole bound: not stored, nothing evicted
    assert cache.get(key(9)) is None and len(cache) == 3


def test_answers_expire_after_their_time_to_live(tmp_path: Path) -> None:
    now = [1000.0]
    cache = ResultCache(max_bytes=10_000, fingerprint="f", ttl_s=60, clock=lambda: now[0])
    news = CacheKey("", "web", 3, True, "news today")
    cache.put(news, b"[]")
    now[0] += 59
    assert cache.get(news) == b"[]"
    cache.save(tmp_path / "c")
    now[0] += 2
    assert cache.get(news) is None and cache.stats.expired == 1
    assert cache.entries_bytes == 0 and len(cache) == 0
    reloaded = ResultCache(max_bytes=10_000, fingerprint="f", ttl_s=60, clock=lambda: now[0])
    assert reloaded.load(tmp_path / "c") == 0  # expired on disk too: the time is kept


class RefusesLargeRequests:
    """A backend (a stand-in for a paid upstream) that refuses a call of more than one query,
    once the test lets it answer: the failure belongs to the request that sent it."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls: list[list[str]] = []

    async def compute(
        self, queries: list[str], topk: int, retriever: str, return_scores: bool
    ) -> list[bytes]:
        self.calls.append(list(queries))
        if len(queries) > 1:
            await self.release.wait()
            raise RuntimeError(f"a call of {len(queries)} queries is over the budget")
        return [b'["%s"]' % query.encode() for query in queries]


def test_a_leaders_own_failure_is_not_its_waiters() -> None:
    """A request waiting on another's computation of its query is not failed by that
    request's own error: it computes the query itself, billed once."""
    backend = RefusesLargeRequests()
    answers = Answers(backend, ResultCache(1 << 20, fingerprint="test"))

    async def leader_then_waiter():
        leader = asyncio.create_task(answers.get(["Haiku", "Sonnet"], 3, "bm25", False))
        await asyncio.sleep(0)  # the leader has claimed both keys
        waiter = asyncio.create_task(answers.get(["Haiku"], 3, "bm25", False))
        await asyncio.sleep(0)  # the waiter waits on the leader's "Haiku"
        backend.release.set()
        results = await asyncio.gather(leader, waiter, return_exceptions=True)
        return results

    led, waited = asyncio.run(leader_then_waiter())
    assert isinstance(led, RuntimeError)
    assert waited.answers == [b'["Haiku"]'] and waited.billed == 1
    assert backend.calls == [["Haiku", "Sonnet"], ["Haiku"]]
    assert answers.in_flight == {}


def test_a_damaged_cache_file_is_one_line_and_kept(tmp_path: Path) -> None:
    """A persisted cache cut short (a disk that filled while another tool copied it) is refused
    at start in one line, and left as it was."""
    from core.errors import UserError

    saved = tmp_path / "answers.cache"
    cache = ResultCache(1 << 20, fingerprint="index-a")
    cache.put(CacheKey("", "bm25", 3, True, "Epic poem by Dante"), b'[{"document":1}]')
    cache.save(saved)
    damaged = saved.read_bytes()[:-5]
    saved.write_bytes(damaged)
    with pytest.raises(UserError, match="is an hdr search cache but damaged"):
        ResultCache(1 << 20, fingerprint="index-a").load(saved)
    assert saved.read_bytes() == damaged


@pytest.mark.parametrize("scoped", [False, True], ids=["small answers", "a scope each"])
def test_the_byte_count_is_what_the_entries_hold(scoped: bool) -> None:
    """Small answers (the fixed overhead dominates) and, worse, each entry under a distinct
    200-character scope (before: not counted at all). Before: tracemalloc saw 1.23x and
    2.46x the count; now within 1.1x either way."""
    import tracemalloc

    from retrieval_server.serving.app import cache_scope

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = ResultCache(max_bytes=4 * 2**20, fingerprint="f")
        i = 0
        while not cache.stats.evictions:
            scope = cache_scope(f"train:{i:06d}:" + "r" * 187) if scoped else ""
            cache.put(CacheKey(scope, "bm25", 3, True, f"query {i}"), b"[%d]" % i)
            i += 1
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(cache) > 1000
    assert 1 / 1.1 <= traced / cache.bytes <= 1.1, (traced, cache.bytes, len(cache))
    assert cache.bytes <= cache.max_bytes


def test_a_cache_file_is_saved_only_over_a_file_of_its_own_fingerprint(
    small_index: Path, tmp_path: Path
) -> None:
    """Two servers of different indexes given one persist_path, both started before either
    stopped. Before: the second to stop wrote its file over the first's (the check ran at
    start only)."""
    from retrieval_server.index.build import build_index

    corpus = tmp_path / "ten.jsonl"
    corpus.write_text(
        "".join(f'{{"id": "{i}", "contents": "\\"Doc {i}\\"\\nText {i}"}}\n' for i in range(10))
    )
    other = tmp_path / "other-index"
    build_index(corpus, other, dense=False, bm25=True, show_progress=False)
    saved = tmp_path / "answers.cache"
    query = ["Epic poem by Dante"]
    with running_server(other, cache={"persist_path": saved}) as second:
        with running_server(small_index, cache={"persist_path": saved}) as first:
            post(first.url, query)
        assert saved.is_file()  # the first stopped first and wrote its answers
        post(second.url, query)
    with running_server(small_index, cache={"persist_path": saved}) as first_again:
        assert cache_health(first_again.url)["loaded"] == 1
        assert ledger(post(first_again.url, query)) == (0, 1)


def test_a_cache_file_keeps_its_mode(small_index: Path, tmp_path: Path) -> None:
    """Before: every save reset the file's mode to 0600 (the temporary file's)."""
    import stat

    saved = tmp_path / "answers.cache"
    with running_server(small_index, cache={"persist_path": saved}) as server:
        post(server.url, ["Epic poem by Dante"])
    saved.chmod(0o644)
    with running_server(small_index, cache={"persist_path": saved}) as server:
        post(server.url, ["Japanese poetry form with 17 syllables"])
    assert stat.S_IMODE(saved.stat().st_mode) == 0o644


def test_a_damaged_cache_header_is_refused_in_one_line_and_kept(
    small_index: Path, tmp_path: Path
) -> None:
    """Before: a header line of `[1]` after a valid magic line crashed `hdr serve` with an
    AttributeError traceback, exit 3."""
    damaged = tmp_path / "answers.cache"
    damaged.write_bytes(FILE_MAGIC + b"[1]\n")
    line = serve_and_fail(small_index, f"cache.persist_path={damaged}")
    assert line == (
        f"hdr: error: cache.persist_path {damaged} is an hdr search cache but its header is"
        " damaged; remove it or choose another path"
    )
    assert damaged.read_bytes() == FILE_MAGIC + b"[1]\n"
