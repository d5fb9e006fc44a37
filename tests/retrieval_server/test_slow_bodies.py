"""Slow senders against a real server: a request whose body trickles in holds a body slot
(`max_body_readers`), never a search slot, and loses it at `body_read_timeout_s` with a 408, so
fast clients are kept out at most until that deadline.

A slow sender is a raw socket that sends a request's headers and then one byte of its body
every 0.1 s: never idle, never finished.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from servers import running_server

WAIT_S = 30  # a state the server should reach, not reached by then, fails the test
DECLARED_BODY_BYTES = 100_000  # never fully sent


def metric(url: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_for_metric(url: str, name: str, value: float) -> None:
    deadline = time.monotonic() + WAIT_S
    while metric(url, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.05)


class SlowSender:
    """A POST /retrieve whose body arrives one byte per 0.1 s until the server answers."""

    def __init__(self, url: str) -> None:
        port = int(url.rsplit(":", 1)[1])
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.sock.sendall(
            b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % DECLARED_BODY_BYTES
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True)
        self.thread.start()

    def _trickle(self) -> None:
        try:
            self.sock.sendall(b'{"queries": ["')
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
        self.thread.join(timeout=WAIT_S)
        self.sock.close()


@contextmanager
def slow_senders(url: str, count: int) -> Iterator[list[SlowSender]]:
    senders = [SlowSender(url) for _ in range(count)]
    try:
        wait_for_metric(url, "hdr_retrieval_bodies_receiving", count)
        yield senders
    finally:
        for sender in senders:
            sender.close()


def test_slow_uploads_hold_body_slots_not_search_slots(small_index: Path) -> None:
    """Three bodies trickling in and one search slot: a fast client is still served at once."""
    config = {"max_concurrent_requests": 1, "max_body_readers": 4, "body_read_timeout_s": 60}
    with running_server(small_index, **config) as server, slow_senders(server.url, 3):
        fast = httpx.post(f"{server.url}/retrieve", json={"queries": ["Haiku"]}, timeout=30)
        assert fast.status_code == 200, fast.text
        assert metric(server.url, "hdr_retrieval_bodies_receiving") == 3


def test_slow_uploads_are_cut_off_at_the_deadline_and_free_their_slots(small_index) -> None:
    """Body slots full: a fast client is refused with 503 + Retry-After; at the deadline each
    slow sender gets a one-line 408 and a closed connection, and the fast client is served."""
    config = {"max_body_readers": 2, "body_read_timeout_s": 2.0}
    with running_server(small_index, **config) as server:
        with slow_senders(server.url, 2) as senders:
            refused = httpx.post(f"{server.url}/retrieve", json={"queries": ["Haiku"]})
            assert refused.status_code == 503
            assert refused.json()["detail"] == "server busy: too many uploads; retry"
            assert refused.headers["retry-after"] == "1"
            assert httpx.get(f"{server.url}/health").status_code == 200  # exempt from slots
            for sender in senders:
                status, headers, body = sender.response()  # returns once the server closes
                assert status == 408
                assert headers["connection"] == "close"
                detail = "request body not received within the 2 s body deadline"
                assert body == {"detail": detail, "errors": []}
        wait_for_metric(server.url, "hdr_retrieval_bodies_receiving", 0)
        served = httpx.post(f"{server.url}/retrieve", json={"queries": ["Haiku"]}, timeout=30)
        assert served.status_code == 200
        assert metric(server.url, "hdr_retrieval_slow_bodies_total") == 2
        rejected = 'hdr_retrieval_rejected_total{reason="body_readers"}'
        assert metric(server.url, rejected) == 1
