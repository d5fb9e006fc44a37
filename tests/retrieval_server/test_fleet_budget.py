"""The fleet's budget and cache in Redis (`cache.backend: redis`) where Redis itself misbehaves,
against real `redis-server` processes and a fake paid API that counts what it receives (real
`hdr serve` proxies on 127.0.0.1): a budget key Redis loses is never refilled from a guess,
before or after a replica restarts, and a settlement across the loss counts once; a password
in the Redis URL's query is never shown; one upstream is one budget however its URL is
spelled; a damaged budget hash, an error reply (out of memory) and garbage at an answer's key
are each answered for what they are; answers waiting for Redis stay inside the cache's bound;
a reservation whose reply was lost is released, and a killed replica's are said and counted."""

from __future__ import annotations

import logging
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

from retrieval_server.config import ServerConfig


def post(url: str, queries: list[str], timeout: float = 60) -> httpx.Response:
    body = {"queries": queries, "topk": 3, "return_scores": True}
    return httpx.post(f"{url}/retrieve", json=body, timeout=timeout)


def fleet(redis_url: str, record: Path, **upstream) -> dict:
    """A proxy's settings: the fleet's budget in Redis, this replica's record of it in `record`."""
    cache = {"backend": "redis", "redis_url": redis_url, "redis_retry_s": 0.2}
    return {"cache": cache, "upstream": {"max_retries": 0, "spend_path": record, **upstream}}


def budget_hash(client: redis.Redis) -> dict[bytes, bytes]:
    keys = client.keys("hdr:budget:*")
    assert len(keys) == 1, keys
    return client.hgetall(keys[0])


def test_a_lost_budget_key_stops_spending_and_is_never_refilled(tmp_path: Path) -> None:
    """Budget 4, all spent, then Redis loses its data (FLUSHALL): every miss is refused in one
    line, by the replica that saw the budget and by one restarted after the loss. Before: the
    key was refilled from the replica's last-seen totals (or zero) and the API received more."""
    with redis_server(tmp_path / "redis", persist=True) as store, fake_upstream() as api:
        settings = fleet(store.url, tmp_path / "a.json", url=api.url, max_calls=4)
        other = fleet(store.url, tmp_path / "b.json", url=api.url, max_calls=4)
        with running_server(None, **settings) as first, running_server(None, **other) as second:
            spent = [post((first, second)[i % 2].url, [f"paid {i}"]) for i in range(4)]
            redis.Redis.from_url(store.url).flushall()
            after_loss = [
                post(s.url, [f"after the loss {i}"]) for i, s in enumerate((first, second))
            ]
            hit = post(first.url, ["paid 0"])
        with running_server(None, **settings) as restarted:
            after_restart = post(restarted.url, ["after a restart"])
            report = httpx.get(f"{restarted.url}/health", timeout=10).json()["upstream"]
    assert [r.status_code for r in spent] == [200] * 4
    assert [r.status_code for r in after_loss] == [503, 503]
    assert hit.status_code == 200  # this replica's cache still answers
    assert after_restart.status_code == 503
    detail = after_restart.json()["detail"]
    assert "\n" not in detail
    assert detail.startswith(f"the fleet's upstream budget is gone from redis at {store.url}")
    assert "restore Redis's data" in detail
    assert api.queries == 4
    assert report["ledger"] == "redis" and report["refusing"] == detail


def test_a_settlement_across_a_loss_is_applied_once(tmp_path: Path) -> None:
    """A forward in flight while the budget key is lost and then restored (Redis's data brought
    back): its settlement waits for the key and is applied once. Before: the key was refilled
    from totals that already held the settlement, which was then applied again (billed 2 for
    1, committed one call below what was reserved)."""
    with redis_server(tmp_path / "redis", persist=True) as store, fake_upstream() as api:
        settings = fleet(store.url, tmp_path / "a.json", url=api.url, max_calls=10)
        client = redis.Redis.from_url(store.url)
        with running_server(None, **settings) as proxy:
            assert post(proxy.url, ["first"]).status_code == 200
            deadline = time.monotonic() + 10
            while budget_hash(client)[b"billed_calls"] != b"1" and time.monotonic() < deadline:
                time.sleep(0.05)
            (key,) = client.keys("hdr:budget:*")
            api.delay_s = 1.0
            answered: list[httpx.Response] = []
            forward = threading.Thread(target=lambda: answered.append(post(proxy.url, ["second"])))
            forward.start()
            api.wait_for_queries(2)  # reserved in Redis and sent
            saved = client.dump(key)  # Redis's data, as a backup holds it
            client.delete(key)  # lost while the call is in flight
            forward.join(timeout=30)
            time.sleep(0.5)  # the settlement has tried the lost key
            assert not client.exists(key), "a settlement refilled the lost budget"
            client.restore(key, 0, saved)
            deadline = time.monotonic() + 10
            while budget_hash(client)[b"billed_calls"] != b"2" and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # a second application would land here
            final = budget_hash(client)
            again = post(proxy.url, ["third"])
    assert answered[0].status_code == 200 and again.status_code == 200
    assert api.queries == 3
    assert final[b"billed_calls"] == b"2" and final[b"committed_calls"] == b"2"


def test_a_fleet_budget_needs_a_record_of_its_own() -> None:
    """A replica keeps the identity of the fleet's budget in its spend file, so that a restart
    after Redis lost the budget knows it existed."""
    with pytest.raises(ValueError, match=r"needs upstream\.spend_path=FILE"):
        ServerConfig(upstream={"url": "http://127.0.0.1:9", "max_calls": 3},
                     cache={"backend": "redis"})  # fmt: skip
    assert ServerConfig(
        upstream={"url": "http://127.0.0.1:9", "max_calls": 3, "spend_path": "record.json"},
        cache={"backend": "redis"},
    )


def test_a_redis_password_in_the_query_string_is_never_shown(tmp_path: Path) -> None:
    """`?password=...` (the only form a unix:// URL has) is masked in the ready line,
    /health, a budget's 503 and the outage's log line. Before: shown in all four."""
    password = "query-pw-4711"
    with redis_server(tmp_path / "redis", persist=True) as store, fake_upstream() as api:
        redis.Redis.from_url(store.url).config_set("requirepass", password)
        url = f"{store.url}?password={password}"
        settings = ("cache.backend=redis", f"cache.redis_url={url}", "cache.redis_retry_s=0.2",
                    "upstream.max_calls=5", f"upstream.spend_path={tmp_path / 'record.json'}",
                    "upstream.max_retries=0")  # fmt: skip
        with serve_process(None, *settings, upstream=api.url) as proxy:
            assert post(proxy.url, ["paid"]).status_code == 200
            store.kill()
            refused = post(proxy.url, ["a miss while Redis is down"])
            health = httpx.get(f"{proxy.url}/health", timeout=10).text
            proxy.stop()
    assert refused.status_code == 503
    shown = f"{store.url}?password=***"
    assert shown in refused.json()["detail"] and shown in health
    assert f"shared with the replicas on {shown}" in proxy.output
    assert f"redis at {shown} unreachable" in proxy.output
    for text in (refused.text, health, proxy.output):
        assert password not in text


def test_one_upstream_is_one_budget_however_its_url_is_spelled(tmp_path: Path) -> None:
    """Three replicas name one upstream as `localhost`, `127.0.0.1` with its default-less
    port and a trailing slash, and `LOCALHOST`: one budget of 5 for the three, so 5 calls
    reach the API. Before: each spelling had a budget of its own (15 calls on a budget of 5)."""
    with redis_server(tmp_path / "redis", persist=True) as store, fake_upstream() as api:
        port = api.url.rsplit(":", 1)[1]
        spellings = [f"http://localhost:{port}", f"http://127.0.0.1:{port}/",
                     f"http://LOCALHOST:{port}/retrieve"]  # fmt: skip
        settings = [
            fleet(store.url, tmp_path / f"record-{i}.json", url=url, max_calls=5)
            for i, url in enumerate(spellings)
        ]
        with (
            running_server(None, **settings[0]) as first,
            running_server(None, **settings[1]) as second,
            running_server(None, **settings[2]) as third,
        ):
            statuses = [
                post(proxy.url, [f"query {i} of {n}"]).status_code
                for n, proxy in enumerate((first, second, third))
                for i in range(5)
            ]
        budgets = redis.Redis.from_url(store.url).keys("hdr:budget:*")
    assert sorted(statuses) == [200] * 5 + [429] * 10
    assert api.queries == 5 and len(budgets) == 1


def test_a_damaged_budget_hash_is_refused_in_one_line_and_left_as_it_is(tmp_path: Path) -> None:
    """`billed_calls` that is not a count (written by hand, or by another program): misses are
    refused with a one-line 503 naming the field, nothing is reserved, /health answers.
    Before: a 500 with a traceback, and committed_calls grew a call a request."""
    with redis_server(tmp_path / "redis", persist=True) as store, fake_upstream() as api:
        settings = fleet(store.url, tmp_path / "a.json", url=api.url, max_calls=10)
        client = redis.Redis.from_url(store.url)
        with running_server(None, **settings) as proxy:
            assert post(proxy.url, ["first"]).status_code == 200
            (key,) = client.keys("hdr:budget:*")
            client.hset(key, "billed_calls", "1.5x")
            before = client.hget(key, "committed_calls")
            refused = [post(proxy.url, [f"miss {i}"]) for i in range(3)]
            after = client.hget(key, "committed_calls")
            health = httpx.get(f"{proxy.url}/health", timeout=10)
    assert [r.status_code for r in refused] == [503] * 3
    detail = refused[0].json()["detail"]
    assert "\n" not in detail and "is damaged (billed_calls is not a count" in detail
    assert before == after and api.queries == 1
    assert health.status_code == 200


def test_an_error_reply_of_redis_is_said_for_what_it_is_not_an_outage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis out of memory under noeviction (maxmemory reached after start): a price-only proxy
    goes on answering misses, /health keeps Redis reachable, and one log line gives Redis's own
    reply; a budgeted proxy refuses misses with a 503 that names the reply. A Redis that would
    fill with answers this way is refused at start for a budget. Before: each error reply
    marked Redis unreachable ("unreachable (OutOfMemoryError)"), and a budgeted Redis with
    maxmemory and noeviction was accepted."""
    caplog.set_level(logging.WARNING, logger="retrieval_server.fleet")
    with redis_server(tmp_path / "redis", persist=True) as store, fake_upstream() as api:
        client = redis.Redis.from_url(store.url)
        priced = fleet(store.url, tmp_path / "a.json", url=api.url, price_per_call=0.01)
        budgeted = fleet(store.url, tmp_path / "b.json", url=api.url, max_calls=10)
        with running_server(None, **priced) as free, running_server(None, **budgeted) as paid:
            assert post(free.url, ["before"]).status_code == 200
            client.config_set("maxmemory", 1)  # every write is refused from now on
            answered = post(free.url, ["out of memory"])
            refused = post(paid.url, ["out of memory too"])
            from_redis = post(paid.url, ["before"])  # the fleet's answer is still read
            shared = httpx.get(f"{free.url}/health", timeout=10).json()["cache"]["shared"]
            client.config_set("maxmemory", 0)
        client.config_set("maxmemory", 10**9)
        result = subprocess.run(
            [sys.executable, "-m", "hdr.cli", "serve", "--upstream", api.url, "--port", "0",
             "upstream.max_calls=5", "cache.backend=redis", f"cache.redis_url={store.url}",
             f"upstream.spend_path={tmp_path / 'c.json'}"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert answered.status_code == 200 and shared["reachable"] is True
    assert from_redis.status_code == 200 and from_redis.headers["x-hdr-cached-queries"] == "1"
    assert refused.status_code == 503
    detail = refused.json()["detail"]
    assert detail.startswith(
        f"the upstream budget is shared in Redis and redis at {store.url} answered an error"
        " (OutOfMemoryError: command not allowed when used memory > 'maxmemory');"
    )
    assert "unreachable" not in detail
    lines = [r.getMessage() for r in caplog.records]
    assert not any("unreachable" in line for line in lines), lines
    errors = [line for line in lines if "answered an error (OutOfMemoryError" in line]
    assert len(errors) == 2, lines  # one for each replica, however many commands it refused
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"hdr: error: redis at {store.url} would fill with answers and then refuse every update"
            " of the budget (maxmemory 1000000000 with maxmemory-policy noeviction)"
        )
    )


def test_settlements_leave_one_key_per_replica_not_one_per_forward(tmp_path: Path) -> None:
    """Each settlement is numbered; Redis keeps the last number a replica applied (one key per
    replica) instead of a key per forward kept a day. Before: 8 forwards left 8 keys."""
    with redis_server(tmp_path / "redis", persist=True) as store, fake_upstream() as api:
        settings = fleet(store.url, tmp_path / "a.json", url=api.url, max_calls=10)
        client = redis.Redis.from_url(store.url)
        with running_server(None, **settings) as proxy:
            for i in range(8):
                assert post(proxy.url, [f"query {i}"]).status_code == 200
            deadline = time.monotonic() + 10
            while budget_hash(client)[b"billed_calls"] != b"8" and time.monotonic() < deadline:
                time.sleep(0.05)
            settled = client.keys("hdr:settled:*")
            final = budget_hash(client)
    assert len(settled) == 1
    assert final[b"billed_calls"] == b"8" == final[b"committed_calls"]


@pytest.mark.parametrize("stored", [b"\x00\xffgarbage", b'{"a": 1}', b'[{"document": 3}]'])
def test_an_answer_in_redis_that_is_not_an_answer_is_never_served(
    tmp_path: Path, stored: bytes
) -> None:
    """Bytes at an answer's key that are not a list of documents: the second replica asks the
    upstream instead, answers it and writes the true answer over them; nothing of them stays
    in its cache. Before: they were served with a 200 and kept in the replica's cache."""
    with redis_server(tmp_path / "redis") as store, fake_upstream() as api:
        cache = {"backend": "redis", "redis_url": store.url}
        client = redis.Redis.from_url(store.url)
        with (
            running_server(None, upstream={"url": api.url}, cache=cache) as first,
            running_server(None, upstream={"url": api.url}, cache=cache) as second,
        ):
            computed = post(first.url, ["Haiku"])
            (key,) = client.keys("hdr:answer:*")
            client.set(key, stored)
            fetched = post(second.url, ["Haiku"])
            rewritten = client.get(key)
            client.delete(key)
            again = post(second.url, ["Haiku"])
    assert fetched.status_code == 200 and fetched.content == computed.content
    assert fetched.headers["x-hdr-billed-queries"] == "1" and api.queries == 2
    assert rewritten != stored and b"Haiku" in rewritten
    assert again.content == computed.content and again.headers["x-hdr-cached-queries"] == "1"


def test_an_outage_refusal_says_which_cached_queries_are_answered(tmp_path: Path) -> None:
    """Redis down: a query that only Redis holds (another replica paid for it) cannot be
    answered, and the 503 says that only this replica's own cache is still served. Before: it
    said "cached queries are still answered" while refusing a cached one."""
    with redis_server(tmp_path / "redis", persist=True) as store, fake_upstream() as api:
        first = fleet(store.url, tmp_path / "a.json", url=api.url, max_calls=10)
        second = fleet(store.url, tmp_path / "b.json", url=api.url, max_calls=10)
        with running_server(None, **first) as paid, running_server(None, **second) as other:
            assert post(paid.url, ["Haiku"]).status_code == 200
            store.stop()
            own = post(paid.url, ["Haiku"])
            only_in_redis = post(other.url, ["Haiku"])
    assert own.status_code == 200
    assert only_in_redis.status_code == 503
    detail = only_in_redis.json()["detail"]
    assert "cached queries are still answered" not in detail
    assert detail.endswith(
        "(queries in this replica's own cache are still answered; those only in Redis are not)"
    )


def test_answers_waiting_for_redis_stay_inside_the_cache_bound(tmp_path: Path) -> None:
    """Redis down while 150 distinct queries are answered by a proxy whose cache holds about
    30 of them: what waits to be written is the cache's own entries, so once Redis is back it
    receives at most what the cache still holds. Before: all 150 answers waited in a queue of
    their own, outside cache.max_bytes, and were written."""
    with redis_server(tmp_path / "redis") as store, fake_upstream() as api:
        cache = {"backend": "redis", "redis_url": store.url, "redis_retry_s": 0.2,
                 "max_bytes": 16_384}  # fmt: skip
        client = redis.Redis.from_url(store.url)
        with running_server(None, upstream={"url": api.url}, cache=cache) as proxy:
            store.stop()
            for i in range(150):
                assert post(proxy.url, [f"query number {i}"]).status_code == 200
            held = httpx.get(f"{proxy.url}/health", timeout=10).json()["cache"]
            store.start()
            deadline = time.monotonic() + 30
            while not httpx.get(f"{proxy.url}/health").json()["cache"]["shared"]["reachable"]:
                assert time.monotonic() < deadline
                post(proxy.url, ["query number 149"])
                time.sleep(0.1)
            time.sleep(1.0)  # the writes of what waited
            written = len(client.keys("hdr:answer:*"))
    assert 0 < held["entries"] < 150 and held["bytes"] <= held["max_bytes"]
    assert 0 < written <= held["entries"]


BUSY_SCRIPT = """
local start = redis.call('TIME')
local now = start
while (now[1] - start[1]) * 1000000 + (now[2] - start[2]) < tonumber(ARGV[1]) do
  now = redis.call('TIME')
end
return 1
"""


def test_a_reservation_whose_reply_was_lost_is_released(tmp_path: Path) -> None:
    """Redis busy for 1.5 s (another client's script) while a reservation waits: the replica's
    0.3 s timeout gives up on it, Redis runs it afterwards and its reply is lost. Once Redis
    answers again the replica releases it, so the budget counts what was billed. Before: the
    call stayed in committed_calls for ever."""
    with redis_server(tmp_path / "redis", persist=True) as store, fake_upstream() as api:
        settings = fleet(store.url, tmp_path / "a.json", url=api.url, max_calls=10)
        settings["cache"] |= {"enabled": False, "redis_timeout_s": 0.3}  # Redis: the budget
        client = redis.Redis.from_url(store.url)
        with running_server(None, **settings) as proxy:
            assert post(proxy.url, ["first"]).status_code == 200
            busy = threading.Thread(target=lambda: client.eval(BUSY_SCRIPT, 0, 1_500_000))
            busy.start()
            time.sleep(0.3)  # the script runs
            lost = post(proxy.url, ["second"])
            busy.join()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                httpx.get(f"{proxy.url}/health", timeout=10)  # tries Redis again
                if budget_hash(client)[b"committed_calls"] == b"1":
                    break
                time.sleep(0.1)
            after = post(proxy.url, ["third"])
            time.sleep(0.5)
            final = budget_hash(client)
    assert lost.status_code == 503 and after.status_code == 200
    assert api.queries == 2
    assert final[b"committed_calls"] == b"2" == final[b"billed_calls"]


def test_a_killed_replicas_reservations_are_said_and_counted(tmp_path: Path) -> None:
    """A replica killed (kill -9) while its forward is in flight: the next replica to start
    says in one log line that its calls were in flight when it stopped, and they stay
    counted as spent. Before: no line."""
    with (
        redis_server(tmp_path / "redis", persist=True) as store,
        fake_upstream(stall=True) as api,
    ):
        settings = ("cache.backend=redis", f"cache.redis_url={store.url}", "cache.redis_lock_s=1",
                    "upstream.max_calls=5", "upstream.max_retries=0")  # fmt: skip
        record = f"upstream.spend_path={tmp_path / 'a.json'}"
        with serve_process(None, *settings, record, upstream=api.url) as doomed:

            def call_that_dies_with_the_replica() -> None:
                with pytest.raises(httpx.TransportError):
                    post(doomed.url, ["Haiku"])

            caller = threading.Thread(target=call_that_dies_with_the_replica)
            caller.start()
            api.wait_for_queries(1)
            doomed.process.kill()
            doomed.process.wait(timeout=30)
            caller.join(timeout=30)
        time.sleep(1.5)  # its liveness expires
        other = f"upstream.spend_path={tmp_path / 'b.json'}"
        with serve_process(None, *settings, other, upstream=api.url) as survivor:
            report = httpx.get(f"{survivor.url}/health", timeout=10).json()["upstream"]
            survivor.stop()
    lines = [line for line in survivor.output.splitlines() if "in flight" in line]
    assert len(lines) == 1, survivor.output
    assert "1 calls were in flight on a replica that stopped without settling them" in lines[0]
    assert report["committed_calls"] == 1 and api.queries == 1
