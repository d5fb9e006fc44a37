"""Slow senders against a real server. A request whose body is arriving holds no slot of any
kind, only the bytes it has sent (`max_buffered_body_bytes`, counted as they arrive); a body idle
for `body_idle_timeout_s` or not whole by `body_read_timeout_s` is answered 408 and its
connection closed. So however many senders stall, a ready request is served.

A stalled upload is a raw socket that sends a request's headers and 13 bytes of its body, then
nothing; a trickling one sends one more byte every 0.1 s: never idle, never finished.
"""

from __future__ import annotations

import json
import re
import resource
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from servers import running_server

WAIT_S = 60  # a state the server should reach, not reached by then, fails the test
DECLARED_BODY_BYTES = 100_000  # never fully sent
STALLED_UPLOADS = 1000
TOKEN = "slow-sender-test-token"


def metric(url: str, name: str, token: str | None = None) -> float:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    text = httpx.get(f"{url}/metrics", headers=headers).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_for_metric(url: str, name: str, value: float, token: str | None = None) -> None:
    deadline = time.monotonic() + WAIT_S
    while (seen := metric(url, name, token)) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value} (last {seen})"
        time.sleep(0.05)


class Upload:
    """A POST /retrieve that sends its headers and the start of its body, then `stall`s
    (nothing more) or trickles one byte per 0.1 s until the server answers."""

    def __init__(
        self,
        url: str,
        first: bytes = b'{"queries": ["',
        trickle: bool = False,
        token: str | None = None,
        declared: int = DECLARED_BODY_BYTES,
    ) -> None:
        port = int(url.rsplit(":", 1)[1])
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        auth = b"Authorization: Bearer %s\r\n" % token.encode() if token else b""
        self.sock.sendall(
            b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"%sContent-Length: %d\r\n\r\n%s" % (auth, declared, first)
        )
        self.stop = threading.Event()
        self.thread = None
        if trickle:
            self.thread = threading.Thread(target=self._trickle, daemon=True)
            self.thread.start()

    def _trickle(self) -> None:
        try:
            while not self.stop.wait(0.1):
                self.sock.sendall(b"a")
        except OSError:
            pass  # the server answered and closed the connection

    def response(self) -> tuple[int, dict[str, str], dict]:
        """Status, headers and JSON body of the answer; waits until the server closes."""
        raw = b""
        while chunk := self.sock.recv(65536):
            raw += chunk
        self.stop.set()
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        return int(lines[0].split()[1]), headers, json.loads(body)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=WAIT_S)
        self.sock.close()


@contextmanager
def uploads(url: str, count: int, token: str | None = None, **kwargs) -> Iterator[list[Upload]]:
    """`count` uploads whose bodies are arriving, once the server counts them all."""
    opened: list[Upload] = []
    try:
        for _ in range(count):
            opened.append(Upload(url, token=token, **kwargs))
        wait_for_metric(url, "hdr_retrieval_bodies_receiving", count, token)
        yield opened
    finally:
        for upload in opened:
            upload.close()


def test_slow_uploads_hold_no_search_slot(small_index: Path) -> None:
    """Three bodies trickling in and one search slot: a fast client is still served at once."""
    config = {"max_concurrent_requests": 1, "body_read_timeout_s": 60}
    with running_server(small_index, **config) as server, uploads(server.url, 3, trickle=True):
        fast = httpx.post(f"{server.url}/retrieve", json={"queries": ["Haiku"]}, timeout=30)
        assert fast.status_code == 200, fast.text
        assert metric(server.url, "hdr_retrieval_bodies_receiving") == 3


def test_idle_and_trickling_senders_are_cut_with_408(small_index: Path) -> None:
    """A stalled body is cut at the idle timeout; one that trickles (never idle) at the
    whole-body deadline; each gets a one-line 408 and a closed connection."""
    config = {"body_idle_timeout_s": 1.0, "body_read_timeout_s": 3.0}
    with running_server(small_index, **config) as server:
        stalled = Upload(server.url)
        slow = Upload(server.url, trickle=True)
        started = time.monotonic()
        status, headers, body = stalled.response()
        assert (status, headers["connection"]) == (408, "close")
        assert body == {"detail": "request body idle for 1 s", "errors": []}
        status, headers, body = slow.response()
        assert time.monotonic() - started >= 2.5  # it was not idle: the deadline cut it
        assert (status, headers["connection"]) == (408, "close")
        detail = "request body not received within the 3 s body deadline"
        assert body == {"detail": detail, "errors": []}
        stalled.close()
        slow.close()
        wait_for_metric(server.url, "hdr_retrieval_bodies_receiving", 0)
        assert metric(server.url, 'hdr_retrieval_slow_bodies_total{reason="idle"}') >= 1
        assert metric(server.url, 'hdr_retrieval_slow_bodies_total{reason="deadline"}') >= 1
        served = httpx.post(f"{server.url}/retrieve", json={"queries": ["Haiku"]}, timeout=30)
        assert served.status_code == 200


def test_memory_in_transit_is_bounded_by_bytes_buffered(small_index: Path) -> None:
    """A 2,048-byte budget: two stalled uploads of 900 bytes leave room for a small request,
    and a third 900-byte upload is refused with 503 + Retry-After, its connection closed."""
    config = {
        "max_body_bytes": 1024,
        "max_buffered_body_bytes": 2048,
        "body_idle_timeout_s": 60,
        "body_read_timeout_s": 60,
    }
    first = b'{"queries": ["' + b"a" * 886  # 900 bytes
    with running_server(small_index, **config) as server:
        with uploads(server.url, 2, first=first, declared=1000):
            wait_for_metric(server.url, "hdr_retrieval_body_bytes_buffered", 1800)
            fast = httpx.post(f"{server.url}/retrieve", json={"queries": ["Haiku"]}, timeout=30)
            assert fast.status_code == 200, fast.text
            third = Upload(server.url, first=first, declared=1000)
            status, headers, body = third.response()
            third.close()
            assert (status, headers["connection"], headers["retry-after"]) == (503, "close", "1")
            assert body["detail"] == "server busy: too many request bytes in transit; retry"
            assert metric(server.url, 'hdr_retrieval_rejected_total{reason="body_bytes"}') == 1
            assert metric(server.url, "hdr_retrieval_body_bytes_buffered") == 1800
        wait_for_metric(server.url, "hdr_retrieval_body_bytes_buffered", 0)


@pytest.fixture
def many_open_files() -> Iterator[None]:
    """Room for the stalled uploads' sockets on both ends (client and server in this process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * STALLED_UPLOADS + 512
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the open-file limit's hard cap {hard} is below the {wanted} needed")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("token", [None, TOKEN], ids=["open", "token"])
def test_a_thousand_stalled_uploads_do_not_keep_a_request_out(
    small_index: Path, many_open_files: None, token: str | None
) -> None:
    """1,000 uploads that sent 13 bytes and stalled (authenticated, when a token is set) hold
    13,000 bytes and nothing else: a normal request is answered 200, an unauthenticated one
    still 401."""
    config = {"body_idle_timeout_s": 120, "body_read_timeout_s": 120, "api_token": token}
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    first = b'{"queries": ['
    assert len(first) == 13
    with (
        running_server(small_index, **config) as server,
        uploads(server.url, STALLED_UPLOADS, token=token, first=first) as held,
    ):
        buffered = metric(server.url, "hdr_retrieval_body_bytes_buffered", token)
        assert buffered == 13 * STALLED_UPLOADS
        body = {"queries": ["Haiku"], "topk": 2}
        fast = httpx.post(f"{server.url}/retrieve", json=body, headers=headers, timeout=30)
        assert fast.status_code == 200, fast.text
        assert len(fast.json()["result"][0]) == 2
        if token:
            anonymous = httpx.post(f"{server.url}/retrieve", json=body, timeout=30)
            assert anonymous.status_code == 401
        receiving = metric(server.url, "hdr_retrieval_bodies_receiving", token)
        assert receiving == len(held)  # all still held while the request was served
