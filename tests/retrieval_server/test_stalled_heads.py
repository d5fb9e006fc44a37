"""Connections that never finish their request head, with real sockets against a real server:
they are cut after `head_timeout_s` (a 408, then closed), and past `max_connections` a new
connection closes the oldest stalled one, so a normal request is always served.

The scale is what the test process's open-file limit allows: each held connection costs two
descriptors here (the client's socket and the server's, in one process)."""

from __future__ import annotations

import re
import resource
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from servers import running_server

HALF_HEAD = b"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl"


def metric(url: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    return float(match.group(1)) if match else 0.0


@contextmanager
def stalled_connections(url: str, count: int) -> Iterator[list[socket.socket]]:
    """`count` connections to `url`: every other one sends half a request head, the others
    nothing at all; none ever sends more."""
    port = int(url.rsplit(":", 1)[1])
    held = []
    try:
        for i in range(count):
            sock = socket.create_connection(("127.0.0.1", port))
            if i % 2:
                sock.sendall(HALF_HEAD)
            held.append(sock)
        yield held
    finally:
        for sock in held:
            sock.close()


def closed_by_server(sock: socket.socket, wait_s: float) -> bytes | None:
    """What the server sent before closing `sock` (None if it is still open after `wait_s`)."""
    sock.settimeout(wait_s)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return received


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def normal_request(url: str) -> httpx.Response:
    body = {"queries": ["Japanese poetry form with 17 syllables"], "topk": 1}
    return httpx.post(f"{url}/retrieve", json=body, timeout=30)


def test_stalled_heads_are_answered_408_and_closed_after_the_head_deadline(
    small_index: Path,
) -> None:
    with running_server(small_index, head_timeout_s=0.5) as server:
        with stalled_connections(server.url, 40) as held:
            assert normal_request(server.url).status_code == 200  # served beside them
            replies = [closed_by_server(sock, wait_s=10) for sock in held]
        # a kept-alive connection that starts its second request and stalls is cut the same way
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200")
            sock.sendall(HALF_HEAD)
            second = closed_by_server(sock, wait_s=10)
        timeouts = metric(server.url, 'hdr_retrieval_connections_cut_total{reason="head_timeout"}')
    assert all(reply is not None for reply in replies), "a stalled head was never cut"
    assert all(reply.startswith(b"HTTP/1.1 408 Request Timeout") for reply in replies)
    assert b'"detail":"request head not received in time"' in replies[0]
    assert second is not None and second.startswith(b"HTTP/1.1 408")
    assert timeouts == 41


def test_past_the_connection_bound_stalled_connections_make_room(small_index: Path) -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    bound = max(16, min(500, (soft - 300) // 4))  # twice the bound held, two fds each
    with (
        running_server(small_index, max_connections=bound, head_timeout_s=600) as server,
        stalled_connections(server.url, 2 * bound) as held,
    ):
        # while twice the bound of stalled connections knock, a normal client gets in
        for _ in range(3):
            assert normal_request(server.url).status_code == 200
        cut = [sock for sock in held if closed_by_server(sock, wait_s=0.01) is not None]
        open_now = metric(server.url, "hdr_retrieval_connections")
        evicted = metric(
            server.url, 'hdr_retrieval_connections_cut_total{reason="evicted_stalled"}'
        )
        # the oldest went first: the last of them are still held
        assert all(closed_by_server(sock, wait_s=0.01) is None for sock in held[-bound // 2 :])
    assert len(cut) >= bound  # at most `bound` connections were ever held at once
    assert evicted >= bound
    assert open_now <= bound + 1  # the /metrics request's own connection is counted too
