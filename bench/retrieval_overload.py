"""Latency of a well-behaved client while slow senders hold connections open.

Starts `hdr serve` on the index in a subprocess, then alternates rounds without and with
`--stalled` uploads held open (each sent its headers and 13 bytes of body, then nothing: the
attack of issue 30, which used to fill the 32 body slots and turn every other POST into a 503).
In each round one closed-loop client sends one-query dense requests for `--seconds`; the rounds
interleave (none, stalled, none, stalled, ...) so a shared machine's drift hits both alike.
Reports q/s, p50/p99 latency and non-200 answers per condition, the server's resident memory
with and without the stalled uploads, and writes bench/results/retrieval_stalled.json.

    .venv/bin/python bench/retrieval_overload.py --index data/index --stalled 1000

The server runs with `body_idle_timeout_s` and `body_read_timeout_s` raised to 600 s so the
uploads stay held for the whole run (with the defaults, 5 s and 30 s, they are cut at 5 s).

`--heads N` holds stalled request *heads* instead: N connections, every other one sending half a
request line and headers, the others nothing, opened by helper processes (so N may pass this
process's open-file limit: 21,000 against 20,000 here). The server runs with `head_timeout_s`
raised to 600 s, so only its connection bound (`max_connections`, by default the open-file
limit less 256) decides which are cut; the report adds the connections the server held and
cut. Writes bench/results/retrieval_stalled_heads.json.

    .venv/bin/python bench/retrieval_overload.py --index data/index --heads 21000
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from retrieval import benchmark_queries, free_port, start_server


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def open_stalled(port: int, count: int) -> list[socket.socket]:
    """`count` uploads that sent headers and 13 bytes of a 100,000-byte body, then stall."""
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(
            b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100000\r\n\r\n{"queries": ['
        )
        sockets.append(sock)
    return sockets


HALF_HEAD = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: appl"
HEADS_PER_HELPER = 9000  # each helper process holds at most this many (its open-file limit)


def hold_heads(port: int, count: int) -> None:
    """A helper process: `count` connections with half a head (every other one) or nothing,
    held until the process is killed; prints "ready" once all are open."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 256), hard))
    held = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        if i % 2:
            sock.sendall(HALF_HEAD)
        held.append(sock)
    print("ready", flush=True)
    time.sleep(3600)


def open_heads(port: int, count: int) -> list[subprocess.Popen]:
    """Helper processes holding `count` stalled heads between them; returns once all are open."""
    helpers = []
    for start in range(0, count, HEADS_PER_HELPER):
        size = min(HEADS_PER_HELPER, count - start)
        command = [sys.executable, __file__, "--hold-heads", f"{port}:{size}"]
        helpers.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True))
    for helper in helpers:
        if helper.stdout is None or helper.stdout.readline().strip() != "ready":
            raise SystemExit("a helper could not open its connections")
    return helpers


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def receiving(url: str) -> float:
    return metric(url, "hdr_retrieval_bodies_receiving")


async def one_client(url: str, queries: list[str], seconds: float) -> tuple[list[float], int]:
    """One closed-loop client; a non-200 answer or a connection error is a failure."""
    latencies, failures = [], 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        deadline = time.perf_counter() + seconds
        i = 0
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                response = await client.post(
                    "/retrieve", json={"queries": [queries[i % len(queries)]]}
                )
                failures += response.status_code != 200
            except httpx.HTTPError:
                failures += 1
            latencies.append(time.perf_counter() - started)
            i += 1
    return latencies, failures


class Uploads:
    """The stalled condition of issue 30: uploads that sent 13 bytes of their body."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.settings = ["body_idle_timeout_s=600", "body_read_timeout_s=600"]
        self.held: list[socket.socket] = []

    def open(self, port: int, url: str) -> None:
        self.held = open_stalled(port, self.count)
        deadline = time.monotonic() + 60
        while receiving(url) < len(self.held):
            if time.monotonic() > deadline:
                raise SystemExit(f"the server never counted {len(self.held)} uploads")
            time.sleep(0.05)

    def close(self, url: str) -> None:
        for sock in self.held:
            sock.close()
        while receiving(url) > 0:
            time.sleep(0.05)


class Heads:
    """Stalled request heads, held by helper processes (their number may pass our own limit)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.settings = ["head_timeout_s=600"]
        self.helpers: list[subprocess.Popen] = []

    def open(self, port: int, url: str) -> None:
        """Open them, then wait until the server has accepted what the kernel queued for it
        (its count of held connections stops moving), so the round measures holding them."""
        self.helpers = open_heads(port, self.count)
        held, previous = metric(url, "hdr_retrieval_connections"), -1.0
        while held != previous:
            time.sleep(1.0)
            held, previous = metric(url, "hdr_retrieval_connections"), held

    def close(self, url: str) -> None:
        for helper in self.helpers:
            helper.kill()
            helper.wait()
        deadline = time.monotonic() + 60
        while metric(url, "hdr_retrieval_connections") > 2 and time.monotonic() < deadline:
            time.sleep(0.1)


def main(
    index: Path = typer.Option(Path("data/index"), help="Index directory (embedded corpus)."),
    stalled: int = typer.Option(1000, help="Stalled uploads held open in the loaded rounds."),
    heads: int = typer.Option(0, help="Hold this many stalled request heads instead of uploads."),
    seconds: float = typer.Option(5.0, help="Seconds per round."),
    rounds: int = typer.Option(2, help="Rounds per condition (interleaved)."),
    out: Path | None = typer.Option(None, help="JSON file (default by mode, under bench/results)."),
    hold_heads_at: str | None = typer.Option(None, "--hold-heads", hidden=True),
) -> None:
    if hold_heads_at is not None:  # the bench's own helper process
        port, count = hold_heads_at.split(":")
        hold_heads(int(port), int(count))
        return
    console = Console()
    condition = Heads(heads) if heads else Uploads(stalled)
    name = "stalled_heads" if heads else "stalled"
    out = out or Path(f"bench/results/retrieval_{name}.json")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, stalled + 1024)), hard))
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="hdr-bench-stalled-", suffix=".log")[1])
    server = start_server(index, port, log, condition.settings)
    url = f"http://127.0.0.1:{port}"
    queries = benchmark_queries()
    by_condition: dict[str, dict] = {
        held: {"latencies": [], "failures": 0, "rss_mib": [], "connections": []}
        for held in ("none", name)
    }
    load_before = list(os.getloadavg())
    try:
        asyncio.run(one_client(url, queries, 1.0))  # warm-up
        for _ in range(rounds):
            for held in ("none", name):
                if held != "none":
                    condition.open(port, url)
                latencies, failures = asyncio.run(one_client(url, queries, seconds))
                cell = by_condition[held]
                cell["latencies"] += latencies
                cell["failures"] += failures
                cell["rss_mib"].append(resident_mib(server.pid))
                cell["connections"].append(metric(url, "hdr_retrieval_connections"))
                if held != "none":
                    condition.close(url)
        cut = {
            line.split('"')[1]: float(line.split()[-1])
            for line in httpx.get(f"{url}/metrics").text.splitlines()
            if line.startswith("hdr_retrieval_connections_cut_total{")
        }
    finally:
        server.terminate()
        server.wait(timeout=60)
    rows = []
    for held, cell in by_condition.items():
        ordered = sorted(cell["latencies"])
        rows.append(
            {
                f"{name}": (heads or stalled) if held != "none" else 0,
                "requests": len(ordered),
                "non_200": cell["failures"],
                "queries_per_s": round(len(ordered) / (rounds * seconds), 1),
                "p50_ms": round(1000 * statistics.median(ordered), 2),
                "p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 2),
                "server_rss_mib": round(max(cell["rss_mib"]), 1),
                "server_connections": max(cell["connections"]),
            }
        )
    report = {
        "command": " ".join(["bench/retrieval_overload.py", *sys.argv[1:]]),
        "server_settings": condition.settings,
        "seconds_per_round": seconds,
        "rounds": rounds,
        "machine": {
            "cpus": os.cpu_count(),
            "open_files_limit": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
            "load_average_before": load_before,
            "load_average_after": list(os.getloadavg()),
        },
        "results": rows,
        "connections_cut": cut,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    table = Table(title=f"one client, one dense query a request, {rounds} x {seconds:g} s rounds")
    for column in (name.replace("_", " "), "requests", "non-200", "q/s", "p50 ms", "p99 ms",
                   "RSS MiB", "connections"):  # fmt: skip
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(str(value) for value in row.values()))
    console.print(table)
    console.print(f"connections cut: {cut}; load average {load_before[0]:.1f} before; "
                  f"written to {out}")  # fmt: skip


if __name__ == "__main__":
    typer.run(main)
