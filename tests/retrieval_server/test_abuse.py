"""Abuse of a real `hdr serve` process (its own memory, measured from /proc): a 100 MB body
without a token, a 100 MB body with one, and 10,000 requests from 200 concurrent clients
against a small queue bound. All traffic goes to 127.0.0.1 and is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from servers import free_port

HDR = str(Path(sys.executable).with_name("hdr"))
TOKEN = "abuse-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HUGE = 100 * 2**20
QUEUE_BOUND = 16


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def memory_kib(self, field: str) -> int:
        """VmRSS (now) or VmHWM (peak) of the server process, in KiB."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise AssertionError(f"{field} not in /proc/{self.process.pid}/status")


@pytest.fixture(scope="module")
def server(small_index: Path) -> Iterator[ServerProcess]:
    port = free_port()
    settings = [f"max_queued_queries={QUEUE_BOUND}", "max_concurrent_requests=128"]
    command = [HDR, "serve", "--index", str(small_index), "--port", str(port)]
    command += ["--retriever", "bm25", "--no-access-log"]
    command += [arg for setting in settings for arg in ("--set", setting)]
    env = {**os.environ, "HDR_API_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    running = ServerProcess(process, port)
    try:
        deadline = time.monotonic() + 480  # a loaded shared machine can take minutes
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                httpx.get(f"{running.url}/health", timeout=5).raise_for_status()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "hdr serve did not come up"
                time.sleep(0.2)
        for _ in range(20):  # warm up, so later memory readings compare like with like
            httpx.post(f"{running.url}/retrieve", json={"queries": ["Batman"]}, headers=AUTH)
        yield running
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert "Traceback" not in output, output[-3000:]


def post_huge_body(port: int, headers: str, total: int = HUGE) -> tuple[int, int, float]:
    """POST a `total`-byte body, raw, stopping as soon as an answer arrives. Returns the status,
    the body bytes actually sent and the seconds until the answer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    started = time.monotonic()
    head = (
        f"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {total}\r\n{headers}\r\n"
    )
    sock.sendall(head.encode())
    sock.setblocking(False)
    chunk = b"[" * 2**20
    sent, answer = 0, b""
    try:
        while sent < total and time.monotonic() - started < 60:
            readable, writable, _ = select.select([sock], [sock], [], 1.0)
            if readable:
                break
            if writable:
                try:
                    sent += sock.send(chunk[: total - sent])
                except (BrokenPipeError, ConnectionResetError):
                    break
        sock.setblocking(True)
        sock.settimeout(30)
        while b"\r\n\r\n" not in answer:
            more = sock.recv(65536)
            if not more:
                break
            answer += more
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer.split()[1]), sent, time.monotonic() - started


def test_100mb_body_without_a_token_is_refused_unread(server: ServerProcess) -> None:
    before = server.memory_kib("VmRSS")
    status, sent, seconds = post_huge_body(server.port, "")
    assert status == 401
    assert sent < HUGE // 4  # the answer came long before the body was through
    assert seconds < 30  # generous: what matters is that it did not wait for 100 MB
    assert server.memory_kib("VmRSS") - before < 20 * 1024


def test_100mb_body_with_the_token_is_413_before_parsing(server: ServerProcess) -> None:
    before = server.memory_kib("VmRSS")
    status, sent, _ = post_huge_body(server.port, f"Authorization: Bearer {TOKEN}\r\n")
    assert status == 413  # Content-Length above max_body_bytes (64 MiB)
    assert sent < HUGE // 4
    assert server.memory_kib("VmRSS") - before < 20 * 1024
    assert httpx.get(f"{server.url}/health").status_code == 200


async def flood(url: str, clients: int, per_client: int) -> tuple[Counter, list[str]]:
    """`clients` concurrent clients, each sending `per_client` one-query requests in a row."""
    statuses: Counter = Counter()
    problems: list[str] = []
    # idle connections close after 2 s, below the server's keep-alive, as hdr's client does
    limits = httpx.Limits(
        max_connections=clients, max_keepalive_connections=clients, keepalive_expiry=2.0
    )
    timeout = httpx.Timeout(60.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:

        async def one_client(k: int) -> None:
            for i in range(per_client):
                body = {"queries": [f"Batman {k} {i}"], "topk": 3}
                try:
                    response = await client.post("/retrieve", json=body, headers=AUTH)
                except httpx.HTTPError as err:  # a hang (timeout) or a reset
                    problems.append(type(err).__name__)
                    continue
                statuses[response.status_code] += 1
                if response.status_code == 503 and response.headers.get("retry-after") != "1":
                    problems.append("503 without Retry-After")

        await asyncio.gather(*(one_client(k) for k in range(clients)))
    return statuses, problems


@pytest.mark.parametrize(
    "per_client",
    [
        pytest.param(5, id="1000-requests"),
        pytest.param(50, id="10000-requests", marks=[pytest.mark.slow, pytest.mark.timeout(1800)]),
    ],
)
def test_200_clients_flooding_a_small_queue_get_200_or_503_with_bounded_memory(
    server: ServerProcess, per_client: int
) -> None:
    """200 concurrent clients, each sending requests in a row (10,000 in all in the slow
    variant, 1,000 in the default suite): every answer is a 200 or a 503 with Retry-After,
    none hangs or resets, the server's peak RSS stays bounded, and it serves normally after."""
    baseline = server.memory_kib("VmRSS")
    statuses, problems = asyncio.run(flood(server.url, clients=200, per_client=per_client))
    assert problems == []
    assert sum(statuses.values()) == 200 * per_client
    assert set(statuses) <= {200, 503}, statuses
    assert statuses[200] > 0 and statuses[503] > 0  # served what fit, refused the rest
    peak = server.memory_kib("VmHWM")
    assert peak - baseline < 200 * 1024, (baseline, peak)  # KiB: bounded, not per request

    metrics = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    assert "hdr_retrieval_queue_queries 0.0" in metrics  # drained
    assert 'status="5' not in metrics.replace('status="503"', "")
    after = httpx.post(f"{server.url}/retrieve", json={"queries": ["Haiku"]}, headers=AUTH)
    assert after.status_code == 200 and '"Haiku"' in after.json()["result"][0][0]["contents"]
