"""Replicas sharing one cache and one budget on a real `redis-server` (started here on
127.0.0.1): a miss on one replica is a hit on the other, byte for byte; identical queries in
flight on two replicas are computed once, and a replica that dies holding a query's lock is
taken over; parallel requests on two proxies never spend past their one budget; with Redis
stopped the replicas keep answering, a paid budget fails closed, and once Redis is back the
billed count is what the upstream received."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
from fake_upstream import fake_upstream
from redis_servers import redis_server
from servers import running_server, serve_process


def post(url: str, queries: list[str], timeout: float = 60, **extra) -> httpx.Response:
    body = {"queries": queries, "topk": 3, "return_scores": True, **extra}
    return httpx.post(f"{url}/retrieve", json=body, timeout=timeout)


def ledger(response: httpx.Response) -> tuple[int, int]:
    assert response.status_code == 200, response.text
    headers = response.headers
    return int(headers["x-hdr-billed-queries"]), int(headers["x-hdr-cached-queries"])


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def shared(url: str, **more) -> dict:
    return {"cache": {"backend": "redis", "redis_url": url, "redis_retry_s": 0.2, **more}}


def test_a_miss_on_one_replica_is_a_hit_on_the_other(small_index: Path, tmp_path: Path) -> None:
    with (
        redis_server(tmp_path / "redis") as store,
        running_server(small_index, **shared(store.url)) as first,
        running_server(small_index, **shared(store.url)) as second,
    ):
        computed = post(first.url, ["Japanese poetry form with 17 syllables"])
        fetched = post(second.url, ["Japanese poetry form with 17 syllables"])
        again = post(second.url, ["Japanese poetry form with 17 syllables"])
        scoped = httpx.post(
            f"{second.url}/retrieve",
            json={"queries": ["Japanese poetry form with 17 syllables"], "return_scores": True},
            headers={"X-HDR-Cache-Scope": "run B"},
        )
        cache = health(second.url)["cache"]
    assert ledger(computed) == (1, 0) and ledger(fetched) == (0, 1) and ledger(again) == (0, 1)
    assert fetched.content == computed.content == again.content
    assert ledger(scoped) == (1, 0)  # a scope is a cache of its own, in the fleet too
    assert (cache["hits"], cache["shared_hits"], cache["misses"]) == (2, 1, 1)
    assert cache["shared"]["reachable"] is True and cache["shared"]["url"] == store.url


def test_identical_queries_in_flight_on_two_replicas_are_computed_once(
    small_index: Path, tmp_path: Path
) -> None:
    """Each replica charges an emulated 1.5 s a computation: the query is sent to both at
    once, and one of them waits for the other's answer instead of computing it again."""
    cost = {"emulated_cost": {"request_latency_ms": 1500.0}}
    with (
        redis_server(tmp_path / "redis") as store,
        running_server(small_index, **shared(store.url), **cost) as first,
        running_server(small_index, **shared(store.url), **cost) as second,
    ):

        async def both() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"queries": ["Flamenco"], "topk": 3, "return_scores": True}
                return await asyncio.gather(
                    client.post(f"{first.url}/retrieve", json=body),
                    client.post(f"{second.url}/retrieve", json=body),
                )

        responses = asyncio.run(both())
        caches = [health(url)["cache"] for url in (first.url, second.url)]
        charged = [
            health(url)["emulated_cost"]["requests_charged"] for url in (first.url, second.url)
        ]
    assert sorted(ledger(r) for r in responses) == [(0, 1), (1, 0)]
    assert responses[0].content == responses[1].content
    assert sum(c["misses"] for c in caches) == 1 and sum(c["shared_waits"] for c in caches) == 1
    assert sorted(charged) == [0, 1]


def test_a_replica_that_dies_holding_the_lock_is_taken_over(
    small_index: Path, tmp_path: Path
) -> None:
    """The first replica (a process of its own, 20 s a computation) takes the query's lock and
    is killed; the second, waiting for its answer, takes the query over once the lock expires
    (2 s) and answers it."""
    with redis_server(tmp_path / "redis") as store:
        holder_settings = (
            "cache.backend=redis", f"cache.redis_url={store.url}", "cache.redis_lock_s=2",
            "emulated_cost.request_latency_ms=20000",
        )  # fmt: skip
        locks = redis.Redis.from_url(store.url)
        with (
            serve_process(small_index, *holder_settings) as holder,
            running_server(small_index, **shared(store.url, redis_lock_s=2.0)) as survivor,
        ):

            def call_that_dies_with_the_holder() -> None:
                with pytest.raises(httpx.TransportError):
                    post(holder.url, ["Haiku"])

            lost = threading.Thread(target=call_that_dies_with_the_holder)
            lost.start()
            deadline = time.monotonic() + 30
            while not locks.keys("hdr:lock:*") and time.monotonic() < deadline:
                time.sleep(0.02)
            assert locks.keys("hdr:lock:*"), "the holder took the lock"
            answer: list[httpx.Response] = []
            waiter = threading.Thread(target=lambda: answer.append(post(survivor.url, ["Haiku"])))
            waiter.start()
            time.sleep(0.3)  # the survivor is waiting on the lock
            os.kill(holder.process.pid, signal.SIGKILL)
            waiter.join(timeout=60)
            lost.join(timeout=60)
            report = health(survivor.url)["cache"]
    assert ledger(answer[0]) == (1, 0)
    assert report["shared"]["took_over"] == 1 and report["misses"] == 1


def test_two_proxies_never_spend_past_their_one_budget(tmp_path: Path) -> None:
    """Twenty parallel requests of distinct queries, ten on each proxy, against a budget of
    seven calls kept in Redis: seven are forwarded and billed, thirteen refused."""
    with (
        redis_server(tmp_path / "redis", persist=True) as store,
        fake_upstream(delay_s=0.2) as api,
    ):
        budget = {"url": api.url, "max_calls": 7, "max_retries": 0}
        records = [{**budget, "spend_path": tmp_path / f"record-{i}.json"} for i in (1, 2)]
        with (
            running_server(None, upstream=records[0], **shared(store.url)) as first,
            running_server(None, upstream=records[1], **shared(store.url)) as second,
        ):

            async def twenty() -> list[int]:
                async with httpx.AsyncClient(timeout=60) as client:
                    posts = [
                        client.post(
                            f"{(first, second)[i % 2].url}/retrieve",
                            json={"queries": [f"query {i}"], "topk": 3},
                        )
                        for i in range(20)
                    ]
                    return [r.status_code for r in await asyncio.gather(*posts)]

            statuses = asyncio.run(twenty())
            assert sorted(statuses) == [200] * 7 + [429] * 13
            reports = settled_reports([first.url, second.url], calls=7, limit=7)
            fleet = redis.Redis.from_url(store.url)
            (key,) = fleet.keys("hdr:budget:*")  # one budget for both proxies
            in_redis = [int(v) for v in fleet.hmget(key, "billed_calls", "committed_calls")]
    assert api.queries == 7
    assert in_redis == [7, 7]
    for report in reports:
        assert (report["calls"], report["committed_calls"], report["ledger"]) == (7, 7, "redis")


def settled_reports(urls: list[str], calls: int, limit: int) -> list[dict]:
    """The replicas' upstream reports once each shows `calls` billed and committed. A replica
    answers its client before its settlement reaches Redis (a background task writes it), so
    another replica's /health sees it a moment later; every report read on the way must stay
    within the budget's `limit`."""
    deadline = time.monotonic() + 60
    while True:
        reports = [health(url)["upstream"] for url in urls]
        for report in reports:
            assert report["committed_calls"] <= limit and report["calls"] <= limit, report
        if all((r["calls"], r["committed_calls"]) == (calls, calls) for r in reports):
            return reports
        seen = [(r["calls"], r["committed_calls"]) for r in reports]
        assert time.monotonic() < deadline, (
            f"the replicas' settlements did not all reach Redis within 60 s: (calls, committed"
            f" calls) per replica {seen}, expected ({calls}, {calls}) on each"
        )
        time.sleep(0.05)


def test_with_redis_stopped_replicas_answer_and_a_paid_budget_fails_closed(
    small_index: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis stopped mid-run: the index replicas keep answering (cached answers and their own
    searches) and say so; the proxy's budget refuses misses in one line (503) while its hits
    are served; a forward in flight when Redis stopped is counted once Redis is back, so the
    fleet's billed count is what the upstream received."""
    caplog.set_level(logging.WARNING, logger="retrieval_server.fleet")
    with (
        redis_server(tmp_path / "redis", persist=True) as store,
        fake_upstream(delay_s=2.0) as api,
    ):
        budget = {"url": api.url, "max_calls": 10, "max_retries": 0,
                  "spend_path": tmp_path / "record.json"}  # fmt: skip
        with (
            running_server(small_index, **shared(store.url)) as first,
            running_server(small_index, **shared(store.url)) as second,
            running_server(None, upstream=budget, **shared(store.url)) as proxy,
        ):
            assert ledger(post(first.url, ["Circus"])) == (1, 0)
            assert ledger(post(second.url, ["Circus"])) == (0, 1)
            assert ledger(post(proxy.url, ["paid before"])) == (1, 0)
            in_flight: list[httpx.Response] = []
            forward = threading.Thread(
                target=lambda: in_flight.append(post(proxy.url, ["paid while Redis stops"]))
            )
            forward.start()
            api.wait_for_queries(2)  # reserved and sent; the upstream answers in 2 s
            store.stop()
            forward.join(timeout=30)

            new_search = post(second.url, ["Accordion"])
            local_hit = post(second.url, ["Circus"])
            refused = post(proxy.url, ["a miss while Redis is down"])
            proxy_hit = post(proxy.url, ["paid before"])
            down = health(second.url)["cache"]["shared"]

            store.start()  # the same port and data (its append-only file)
            deadline = time.monotonic() + 30
            while not health(proxy.url)["cache"]["shared"]["reachable"]:
                assert time.monotonic() < deadline, "the proxy saw Redis come back"
                time.sleep(0.1)
            after = post(proxy.url, ["a miss once Redis is back"])
            report = health(proxy.url)["upstream"]
            back = health(second.url)["cache"]
            # what the second replica searched while Redis was down is written once it is back
            answers = redis.Redis.from_url(store.url)
            pattern = f"hdr:answer:{back['fingerprint']}:*"
            while len(answers.keys(pattern)) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            from_the_fleet = post(first.url, ["Accordion"])
    assert ledger(in_flight[0]) == (1, 0)
    assert ledger(new_search) == (1, 0) and ledger(local_hit) == (0, 1)
    assert ledger(proxy_hit) == (0, 1)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    detail = refused.json()["detail"]
    assert detail.startswith("the upstream budget is shared in Redis and redis at ")
    assert detail.endswith("unreachable (ConnectionError); calls are refused until it is back"
                           " (queries in this replica's own cache are still answered;"
                           " those only in Redis are not)")  # fmt: skip
    assert down["reachable"] is False and "unreachable" in down["reason"]
    assert ledger(after) == (1, 0) and back["shared"]["reachable"] is True
    assert ledger(from_the_fleet) == (0, 1) and from_the_fleet.content == new_search.content
    assert api.queries == 3 and report["calls"] == 3 == report["committed_calls"]
    # one line for each replica that met the outage (the first was not asked meanwhile)
    lines = [r.getMessage() for r in caplog.records]
    unreachable = [line for line in lines if "unreachable (ConnectionError): serving" in line]
    assert len(unreachable) == 2, lines
    assert sum("the upstream budget refuses misses (503)" in line for line in unreachable) == 1
    assert sum("is reachable again after" in line for line in lines) == 2, lines


def test_a_budget_in_a_redis_that_would_forget_it_is_refused(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis", persist=False) as store, fake_upstream() as api:
        result = subprocess.run(
            [sys.executable, "-m", "hdr.cli", "serve", "--upstream", api.url, "--port", "0",
             "upstream.max_calls=5", "cache.backend=redis", f"cache.redis_url={store.url}",
             f"upstream.spend_path={tmp_path / 'record.json'}"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"hdr: error: redis at {store.url} does not persist (appendonly no): a restart of Redis"
        " would forget the spend; run it with appendonly yes and maxmemory-policy volatile-lru (or"
        " noeviction without maxmemory) to keep the upstream budget there"
    )
