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
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import statistics
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


def receiving(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("hdr_retrieval_bodies_receiving "):
            return float(line.split()[1])
    return 0.0


async def one_client(url: str, queries: list[str], seconds: float) -> tuple[list[float], int]:
    latencies, failures = [], 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        deadline = time.perf_counter() + seconds
        i = 0
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            response = await client.post("/retrieve", json={"queries": [queries[i % len(queries)]]})
            latencies.append(time.perf_counter() - started)
            failures += response.status_code != 200
            i += 1
    return latencies, failures


def main(
    index: Path = typer.Option(Path("data/index"), help="Index directory (embedded corpus)."),
    stalled: int = typer.Option(1000, help="Stalled uploads held open in the loaded rounds."),
    seconds: float = typer.Option(5.0, help="Seconds per round."),
    rounds: int = typer.Option(2, help="Rounds per condition (interleaved)."),
    out: Path = typer.Option(Path("bench/results/retrieval_stalled.json"), help="JSON file."),
) -> None:
    console = Console()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, stalled + 1024)), hard))
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="hdr-bench-stalled-", suffix=".log")[1])
    settings = ["body_idle_timeout_s=600", "body_read_timeout_s=600"]
    server = start_server(index, port, log, settings)
    url = f"http://127.0.0.1:{port}"
    queries = benchmark_queries()
    by_condition: dict[str, dict] = {
        name: {"latencies": [], "failures": 0, "rss_mib": []} for name in ("none", "stalled")
    }
    load_before = list(os.getloadavg())
    try:
        asyncio.run(one_client(url, queries, 1.0))  # warm-up
        for _ in range(rounds):
            for name in ("none", "stalled"):
                held = open_stalled(port, stalled) if name == "stalled" else []
                deadline = time.monotonic() + 60
                while held and receiving(url) < len(held):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"the server never counted {len(held)} uploads")
                    time.sleep(0.05)
                latencies, failures = asyncio.run(one_client(url, queries, seconds))
                cell = by_condition[name]
                cell["latencies"] += latencies
                cell["failures"] += failures
                cell["rss_mib"].append(resident_mib(server.pid))
                for sock in held:
                    sock.close()
                while held and receiving(url) > 0:
                    time.sleep(0.05)
    finally:
        server.terminate()
        server.wait(timeout=60)
    rows = []
    for name, cell in by_condition.items():
        ordered = sorted(cell["latencies"])
        rows.append(
            {
                "stalled_uploads": stalled if name == "stalled" else 0,
                "requests": len(ordered),
                "non_200": cell["failures"],
                "queries_per_s": round(len(ordered) / (rounds * seconds), 1),
                "p50_ms": round(1000 * statistics.median(ordered), 2),
                "p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 2),
                "server_rss_mib": round(max(cell["rss_mib"]), 1),
            }
        )
    report = {
        "command": " ".join(["bench/retrieval_overload.py", *sys.argv[1:]]),
        "server_settings": settings,
        "seconds_per_round": seconds,
        "rounds": rounds,
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": list(os.getloadavg()),
        },
        "results": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    table = Table(title=f"one client, one dense query a request, {rounds} x {seconds:g} s rounds")
    for column in ("stalled uploads", "requests", "non-200", "q/s", "p50 ms", "p99 ms", "RSS MiB"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(str(value) for value in row.values()))
    console.print(table)
    console.print(f"load average {load_before[0]:.1f} before; written to {out}")


if __name__ == "__main__":
    typer.run(main)
