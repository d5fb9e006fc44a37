"""The spend budget of proxy mode against a fake paid API that counts what it receives (real
`hdr serve` proxies on 127.0.0.1): a call that was sent is billed whether or not its client
stays; retries and timed-out attempts are billed as an API bills them; the spend survives a
restart, even a kill -9 in the middle of a call; a budget a restart would forget is refused."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fake_upstream import fake_upstream
from servers import running_server, serve_process

from retrieval_server.config import ServerConfig


def post(url: str, queries: list[str], timeout: float = 30) -> httpx.Response:
    body = {"queries": queries, "topk": 3, "return_scores": True}
    return httpx.post(f"{url}/retrieve", json=body, timeout=timeout)


def upstream_health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()["upstream"]


def settled(url: str, timeout_s: float = 10) -> dict:
    """The proxy's upstream report once no call is in flight (committed = billed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = upstream_health(url)
        if report["committed_calls"] == report["calls"] or time.monotonic() > deadline:
            return report
        time.sleep(0.05)


def test_clients_that_leave_cannot_overspend_or_go_unbilled(tmp_path: Path) -> None:
    """The issue's review: ten clients with distinct queries give up after 0.3 s on an API
    that takes 1 s, then four normal ones, on a budget of 3 calls. Before: the API received
    13 queries and /health said 0 calls. Now: 3 queries, all billed, their answers cached."""
    budget = {"max_calls": 3, "max_retries": 0, "spend_path": tmp_path / "spend.json"}
    with (
        fake_upstream(delay_s=1.0) as api,
        running_server(None, upstream={"url": api.url, **budget}) as proxy,
    ):

        async def give_up_early() -> list[int | None]:
            async with httpx.AsyncClient(base_url=proxy.url, timeout=0.3) as client:

                async def one(i: int) -> int | None:
                    try:
                        body = {"queries": [f"leaving query {i}"], "topk": 3, "return_scores": True}
                        return (await client.post("/retrieve", json=body)).status_code
                    except httpx.TimeoutException:
                        return None  # the client left

                return await asyncio.gather(*(one(i) for i in range(10)))

        left = asyncio.run(give_up_early())
        report = settled(proxy.url)
        normal = [post(proxy.url, [f"normal query {i}"]) for i in range(4)]
        again = post(proxy.url, api.received)  # the queries that were paid for
        final = upstream_health(proxy.url)
    # 3 forwarded (their clients left), 7 refused (a loaded machine may let them leave too)
    assert left.count(None) >= 3 and set(left) <= {None, 429}, left
    assert api.queries == 3 and len(set(api.received)) == 3
    assert report["calls"] == 3 == report["committed_calls"]
    assert [r.status_code for r in normal] == [429] * 4
    assert "upstream.max_calls 3 leaves 0 calls" in normal[0].json()["detail"]
    # what was paid for while its clients were gone was kept: hits now, billed nothing
    assert again.status_code == 200 and again.headers["x-hdr-billed-queries"] == "0"
    assert final["calls"] == 3 and api.queries == 3


def test_a_leader_that_leaves_hands_its_paid_answer_to_the_waiting_request() -> None:
    """Two requests for one query: the first (the leader) gives up after 0.3 s, the second
    waits. Before: the waiter forwarded the query again (2 calls to the API, 1 billed). Now:
    one call, billed once, and the waiter gets its answer."""
    with (
        fake_upstream(delay_s=1.0) as api,
        running_server(None, upstream={"url": api.url, "max_retries": 0}) as proxy,
    ):
        leader_left = threading.Event()

        def leader() -> None:
            with pytest.raises(httpx.TimeoutException):
                post(proxy.url, ["Haiku"], timeout=0.3)
            leader_left.set()

        thread = threading.Thread(target=leader)
        thread.start()
        api.wait_for_queries(1)  # the leader's forward is on its way
        waited = post(proxy.url, ["Haiku"])
        thread.join()
        report = settled(proxy.url)
    assert leader_left.is_set()
    assert waited.status_code == 200 and waited.headers["x-hdr-cached-queries"] == "1"
    assert waited.json()["result"][0][0]["document"]["id"] == "Haiku"
    assert api.queries == 1 and report["calls"] == 1


@pytest.mark.parametrize(("bill_timeouts", "billed"), [(True, 2), (False, 0)])
def test_timed_out_attempts_are_billed_as_the_api_bills_them(
    bill_timeouts: bool, billed: int
) -> None:
    """Two attempts that the API received and never answered in time: billed twice by
    default (an API bills what it received), not at all with upstream.bill_timeouts=false.
    Before: never billed."""
    settings = {"timeout_s": 0.3, "max_retries": 1, "backoff_s": 0.01,
                "bill_timeouts": bill_timeouts}  # fmt: skip
    with (
        fake_upstream(stall=True) as api,
        running_server(None, upstream={"url": api.url, **settings}) as proxy,
    ):
        response = post(proxy.url, ["Haiku"])
        report = upstream_health(proxy.url)
    assert response.status_code == 504
    assert api.queries == 2
    assert report["calls"] == billed == report["committed_calls"]


def test_a_retry_needs_budget_of_its_own(tmp_path: Path) -> None:
    """A budget of one call and an API that never answers: the first attempt is billed, the
    retry is not sent. Before: three attempts on a budget of one."""
    settings = {"timeout_s": 0.3, "max_retries": 2, "backoff_s": 0.01, "max_calls": 1,
                "spend_path": tmp_path / "spend.json"}  # fmt: skip
    with (
        fake_upstream(stall=True) as api,
        running_server(None, upstream={"url": api.url, **settings}) as proxy,
    ):
        response = post(proxy.url, ["Haiku"])
        report = upstream_health(proxy.url)
    assert response.status_code == 504
    detail = response.json()["detail"]
    assert detail.startswith(f"upstream {api.url}/retrieve did not answer within 0.3 s")
    assert "not retried: upstream budget spent: upstream.max_calls 1 leaves 0 calls" in detail
    assert "\n" not in detail
    assert api.queries == 1 and report["calls"] == 1


def test_the_spend_survives_a_restart_in_a_file_that_keeps_its_mode(tmp_path: Path) -> None:
    """Before: the budget started again with every restart (a crash loop spends without
    limit). The file is JSON, written whole, and keeps the mode its user gave it."""
    spend = tmp_path / "spend.json"
    settings = {"max_calls": 2, "spend_path": spend, "price_per_call": 0.5}
    with fake_upstream() as api:
        with running_server(None, upstream={"url": api.url, **settings}) as proxy:
            assert post(proxy.url, ["Haiku", "Circus"]).status_code == 200
        kept = json.loads(spend.read_text())
        spend.chmod(0o640)
        with running_server(None, upstream={"url": api.url, **settings}) as proxy:
            refused = post(proxy.url, ["Dada"])
            report = upstream_health(proxy.url)
    assert (kept["calls"], kept["spent"], kept["unsettled_calls"]) == (2, 1.0, 0)
    assert api.queries == 2
    assert refused.status_code == 429
    assert "leaves 0 calls, this request needs 1 (2 billed so far)" in refused.json()["detail"]
    assert (report["calls"], report["spent"], report["ledger"]) == (2, 1.0, "file")
    assert stat.S_IMODE(spend.stat().st_mode) == 0o640
    assert not list(tmp_path.glob(".spend.json.*"))  # no temporary file left beside it


def test_a_proxy_killed_in_the_middle_of_a_call_has_that_call_counted(tmp_path: Path) -> None:
    """kill -9 while a forward is in flight: the reservation was in the spend file before the
    call was sent, so the next server counts it as spent (unsettled) and the budget of one
    call is used up; the API received one query in all."""
    spend = tmp_path / "spend.json"
    settings = ("upstream.max_calls=1", f"upstream.spend_path={spend}", "upstream.max_retries=0")
    with fake_upstream(stall=True) as api:
        with serve_process(None, *settings, upstream=api.url) as proxy:

            def call_that_dies_with_the_proxy() -> None:
                with pytest.raises(httpx.TransportError):
                    post(proxy.url, ["Haiku"])

            caller = threading.Thread(target=call_that_dies_with_the_proxy)
            caller.start()
            api.wait_for_queries(1)
            os.kill(proxy.process.pid, signal.SIGKILL)
            proxy.process.wait(timeout=30)
            caller.join(timeout=30)
        api.stall = False
        with serve_process(None, *settings, upstream=api.url) as proxy:
            report = upstream_health(proxy.url)
            refused = post(proxy.url, ["Circus"])
    assert report["calls"] == 0 and report["committed_calls"] == 1
    assert refused.status_code == 429 and api.queries == 1
    assert "calls were in flight when the last server stopped" in proxy.output


def test_a_budget_that_a_restart_would_forget_is_refused() -> None:
    with pytest.raises(ValueError, match=r"needs upstream\.spend_path=FILE"):
        ServerConfig(upstream={"url": "http://127.0.0.1:9", "max_calls": 3})
    with pytest.raises(ValueError, match=r"needs upstream\.spend_path=FILE"):
        ServerConfig(upstream={"url": "http://127.0.0.1:9", "max_spend": 3.0})
    # without a budget there is nothing to keep; spend is still counted (in memory)
    assert ServerConfig(upstream={"url": "http://127.0.0.1:9", "price_per_call": 0.1})


def test_a_spend_path_that_is_not_a_spend_file_is_refused_and_kept(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with fake_upstream() as api:
        result = subprocess.run(
            [sys.executable, "-m", "hdr.cli", "serve", "--upstream", api.url, "--port", "0",
             "upstream.max_calls=3", f"upstream.spend_path={notes}"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("hdr: error:")]
    assert len(lines) == 1 and "is not an hdr spend file" in lines[0], result.stderr
    assert notes.read_text() == "my notes\n"


def test_a_second_proxy_on_the_same_spend_file_is_refused(tmp_path: Path) -> None:
    """One spend file, one server: while a proxy runs on it, a second (a replacement started
    before the first has drained) is refused in one line and sends nothing. Before: both
    spent the same calls (4 sent with 2 left), and the last to write won the file."""
    spend = tmp_path / "spend.json"
    settings = {"max_calls": 2, "spend_path": spend}
    with fake_upstream() as api, running_server(None, upstream={"url": api.url, **settings}):
        result = subprocess.run(
            [sys.executable, "-m", "hdr.cli", "serve", "--upstream", api.url, "--port", "0",
             "upstream.max_calls=2", f"upstream.spend_path={spend}"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        kept = spend.read_bytes() if spend.exists() else b""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("hdr: error:")]
    assert len(lines) == 1, result.stderr
    assert f"upstream.spend_path {spend} is in use by another running hdr serve" in lines[0]
    assert api.queries == 0 and kept == (spend.read_bytes() if spend.exists() else b"")


def test_a_stopped_proxy_lets_the_next_one_take_its_spend_file(tmp_path: Path) -> None:
    spend = tmp_path / "spend.json"
    settings = {"url": "", "max_calls": 2, "spend_path": spend}
    with fake_upstream() as api:
        settings["url"] = api.url
        with running_server(None, upstream=settings) as proxy:
            assert post(proxy.url, ["Haiku"]).status_code == 200
        with running_server(None, upstream=settings) as proxy:
            assert post(proxy.url, ["Circus"]).status_code == 200
            refused = post(proxy.url, ["Dada"])
    assert refused.status_code == 429 and api.queries == 2


SPEND_FILE = {"kind": "hdr upstream spend", "upstream": "", "calls": 3, "spent": 0.0,
              "unsettled_calls": 0, "unsettled_spend": 0.0}  # fmt: skip


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ({"calls": -1000}, "('calls' is -1000, not a count)"),
        ({"unsettled_spend": -2.5}, "('unsettled_spend' is -2.5, not a count)"),
        ("cut short", "(cut short: not JSON)"),
        ("empty", "(empty)"),
    ],
    ids=["negative calls", "negative spend", "truncated", "empty"],
)
def test_a_damaged_spend_file_is_refused_without_advising_a_new_one(
    tmp_path: Path, damage: dict | str, named: str
) -> None:
    """A negative count (which would buy calls) and a file cut short are refused in one line
    that never suggests another path (a new spend file starts the budget from zero); the file
    is left as it is. Before: -1000 calls forwarded misses past the budget, and a truncated
    file was "not an hdr spend file ...: choose another path"."""
    spend = tmp_path / "spend.json"
    with fake_upstream() as api:
        content = json.dumps({**SPEND_FILE, "upstream": api.url}, indent=2)
        if damage == "cut short":
            content = content[: len(content) // 2]
        elif damage == "empty":
            content = ""
        else:
            content = json.dumps({**SPEND_FILE, "upstream": api.url, **damage})
        spend.write_text(content)
        result = subprocess.run(
            [sys.executable, "-m", "hdr.cli", "serve", "--upstream", api.url, "--port", "0",
             "upstream.max_calls=3", f"upstream.spend_path={spend}"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("hdr: error:")]
    assert len(lines) == 1, result.stderr
    assert f"upstream.spend_path {spend} is an hdr spend file but damaged {named}" in lines[0]
    assert "choose another path" not in lines[0]
    assert spend.read_text() == content and api.queries == 0
