"""Retrieval server benchmark: queries/s and latency at concurrency 1, 8 and 32.

Starts `hdr serve` on the index in a subprocess (the real server, its own process and GIL), then
for each retriever (dense, bm25), request shape (1 query per request, 32 queries per request) and
concurrency (1, 8, 32 clients, each sending its next request when the last one returns) runs for
a fixed time and records throughput, latency percentiles and errors. Queries are the corpus's
short descriptions (the task's question style). Writes bench/results/retrieval.json, prints a table.

    .venv/bin/python bench/retrieval.py --index data/index

Targets: dense, 1 query per request: at least 130 queries/s with 1 client and at least 260 with 32
clients (issue 11: 2x and 5x Search-R1's own server on this 2-core machine), and no request fails.
The machine's load average before and after the run is recorded: these numbers mean little on a
machine others are using.

The overload cell (`--cells overload`, or `all`) starts a second server with a small queue bound
(`--queue-bound`, in queries) and runs 256 closed-loop clients for 30 s, one dense query per
request; a client answered 503 waits a random share of Retry-After before its next request, as
hdr's client does. Before it, one client for 10 s measures what the machine serves right now
(useful on a shared machine). It reports goodput (queries/s answered 200), the 503 share,
latency of the 200s, other errors and the server's peak RSS (VmHWM), and writes
bench/results/retrieval_overload.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import typer
from fastapi import FastAPI, Request, Response
from rich.console import Console
from rich.table import Table

CONCURRENCY = (1, 8, 32)
OVERLOAD_CLIENTS = 256
OVERLOAD_SECONDS = 30.0
QUERIES_PER_REQUEST = (1, 32)
RETRIEVERS = ("dense", "bm25")
TARGET_QPS = {1: 130.0, 32: 260.0}  # dense, 1 query per request: clients -> queries/s
HDR = str(Path(sys.executable).with_name("hdr"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def searching(settings: list[str]) -> list[str]:
    """The server settings with the result cache off, unless a cache.* setting is given."""
    return settings if any(s.startswith("cache.") for s in settings) else [*settings, NO_CACHE]


def start_server(
    index: Path | None, port: int, log: Path, settings: list[str], upstream: str | None = None
) -> subprocess.Popen:
    """`hdr serve` in a subprocess (with `--set` settings) on `index`, or a proxy of
    `upstream`; returns once /health answers."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("HDR_API_TOKEN", None)
    source = ["--index", str(index)] if upstream is None else ["--upstream", upstream]
    command = [HDR, "serve", *source, "--port", str(port), "--no-access-log"]
    command += [arg for setting in searching(settings) for arg in ("--set", setting)]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None:
            raise SystemExit(f"hdr serve exited with {process.returncode}; see {log}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).raise_for_status()
            return process
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                process.terminate()
                raise SystemExit(f"hdr serve did not come up; see {log}") from None
            time.sleep(0.3)


def benchmark_queries(count: int = 2048) -> list[str]:
    """Short descriptions of the embedded corpus's articles, as questions are made."""
    from retrieval_server.index.corpus import iter_vital_articles

    descriptions = [a.description for a in iter_vital_articles() if a.description]
    step = max(1, len(descriptions) // count)
    return descriptions[::step][:count]


async def run_cell(
    url: str, queries: list[str], retriever: str, per_request: int, clients: int, seconds: float
) -> dict:
    """`clients` closed-loop clients for `seconds`; latency per request, throughput in queries."""
    latencies: list[float] = []
    errors = 0
    next_query = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one_client(deadline: float) -> None:
            nonlocal errors, next_query
            while time.perf_counter() < deadline:
                batch = [queries[(next_query + i) % len(queries)] for i in range(per_request)]
                next_query += per_request
                body = {"queries": batch, "topk": 3, "retriever": retriever}
                started = time.perf_counter()
                try:
                    response = await client.post("/retrieve", json=body)
                    ok = response.status_code == 200 and len(response.json()["result"]) == len(
                        batch
                    )
                except httpx.HTTPError:
                    ok = False
                latencies.append(time.perf_counter() - started)
                errors += not ok

        warmup = time.perf_counter() + min(1.0, seconds / 4)
        await asyncio.gather(*(one_client(warmup) for _ in range(clients)))
        latencies.clear()
        errors = 0
        started = time.perf_counter()
        await asyncio.gather(*(one_client(started + seconds) for _ in range(clients)))
        elapsed = time.perf_counter() - started

    ordered = sorted(latencies)
    return {
        "retriever": retriever,
        "queries_per_request": per_request,
        "concurrency": clients,
        "requests": len(latencies),
        "errors": errors,
        "seconds": round(elapsed, 2),
        "queries_per_s": round(len(latencies) * per_request / elapsed, 1),
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(1000 * statistics.median(ordered), 1),
        "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
    }


def peak_rss_mib(pid: int) -> float:
    """VmHWM (peak resident set) of a process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def run_overload_cell(url: str, queries: list[str], clients: int, seconds: float) -> dict:
    """`clients` closed-loop clients, one dense query per request; 503s back off."""
    ok_latencies: list[float] = []
    statuses: dict[str, int] = {}
    next_query = 0
    rng = random.Random(0)
    limits = httpx.Limits(
        max_connections=clients, max_keepalive_connections=clients, keepalive_expiry=2.0
    )

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one_client(deadline: float) -> None:
            nonlocal next_query
            while time.perf_counter() < deadline:
                body = {"queries": [queries[next_query % len(queries)]], "topk": 3}
                next_query += 1
                started = time.perf_counter()
                try:
                    response = await client.post("/retrieve", json=body)
                    status = str(response.status_code)
                except httpx.HTTPError as err:
                    status, response = type(err).__name__, None
                statuses[status] = statuses.get(status, 0) + 1
                if status == "200":
                    ok_latencies.append(time.perf_counter() - started)
                elif status == "503":
                    retry_after = float(response.headers.get("retry-after", 1))
                    await asyncio.sleep(rng.uniform(0, retry_after))

        started = time.perf_counter()
        await asyncio.gather(*(one_client(started + seconds) for _ in range(clients)))
        elapsed = time.perf_counter() - started

    total = sum(statuses.values())
    ordered = sorted(ok_latencies) or [float("nan")]
    return {
        "clients": clients,
        "seconds": round(elapsed, 2),
        "requests": total,
        "statuses": statuses,
        "goodput_queries_per_s": round(len(ok_latencies) / elapsed, 1),
        "share_503": round(statuses.get("503", 0) / max(total, 1), 3),
        "other_errors": total - statuses.get("200", 0) - statuses.get("503", 0),
        "p50_ok_ms": round(1000 * statistics.median(ordered), 1),
        "p99_ok_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
    }


def overload(index: Path, queue_bound: int, settings: list[str], console: Console) -> dict:
    """The overload cell on its own server (queue bound `queue_bound` queries)."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="hdr-bench-overload-", suffix=".log")[1])
    server_settings = searching([*settings, f"max_queued_queries={queue_bound}"])
    console.print(f"overload: hdr serve with {server_settings} (log: {log})")
    server = start_server(index, port, log, server_settings)
    url = f"http://127.0.0.1:{port}"
    try:
        queries = benchmark_queries()
        # the same server with one client first (warm-up included): what this machine serves
        # right now, so the overload goodput can be read against it on a shared machine
        reference = asyncio.run(run_cell(url, queries, "dense", 1, 1, 10.0))
        baseline = peak_rss_mib(server.pid)
        cell = asyncio.run(run_overload_cell(url, queries, OVERLOAD_CLIENTS, OVERLOAD_SECONDS))
        cell["one_client_queries_per_s"] = reference["queries_per_s"]
        cell["peak_rss_mib"] = round(peak_rss_mib(server.pid), 1)
        cell["rss_before_mib"] = round(baseline, 1)
        metrics = httpx.get(f"{url}/metrics").text
        health = httpx.get(f"{url}/health").status_code
    finally:
        server.terminate()
        server.wait(timeout=60)
    cell["queue_bound_queries"] = queue_bound
    cell["server_settings"] = server_settings
    cell["health_after"] = health
    cell["server_5xx_other_than_503"] = sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("hdr_retrieval_requests_total")
        and 'status="5' in line
        and 'status="503"' not in line
    )
    return cell


def print_overload(cell: dict, console: Console) -> None:
    table = Table(title=f"overload: {cell['clients']} clients, {cell['seconds']:.0f} s, dense")
    for column in ("queue bound", "1 client q/s", "goodput q/s", "503 share", "p50 ms (200s)",
                   "p99 ms (200s)", "other errors", "peak RSS MiB"):  # fmt: skip
        table.add_column(column, justify="right")
    table.add_row(
        str(cell["queue_bound_queries"]), f"{cell['one_client_queries_per_s']:.1f}",
        f"{cell['goodput_queries_per_s']:.1f}",
        f"{cell['share_503']:.1%}", f"{cell['p50_ok_ms']:.0f}", f"{cell['p99_ok_ms']:.0f}",
        str(cell["other_errors"]), f"{cell['peak_rss_mib']:.0f}",
    )  # fmt: skip
    console.print(table)


def print_table(results: list[dict], console: Console) -> None:
    table = Table(title="hdr retrieval server benchmark (topk 3)")
    for column in ("retriever", "queries/req", "clients", "queries/s", "p50 ms", "p99 ms",
                   "requests", "errors"):  # fmt: skip
        table.add_column(column, justify="right")
    for row in results:
        table.add_row(
            row["retriever"], str(row["queries_per_request"]), str(row["concurrency"]),
            f"{row['queries_per_s']:.1f}", f"{row['p50_ms']:.1f}", f"{row['p99_ms']:.1f}",
            str(row["requests"]), str(row["errors"]),
        )  # fmt: skip
    console.print(table)


def dense_single_query_qps(results: list[dict]) -> dict[int, float]:
    """Dense queries/s with one query per request, by number of clients."""
    return {
        r["concurrency"]: r["queries_per_s"]
        for r in results
        if r["retriever"] == "dense" and r["queries_per_request"] == 1
    }


# --- the limit cells: encoder alone, a bare endpoint and hdr serve, interleaved -------------

LIMIT_CELLS = ((1, 1), (8, 1), (32, 1), (1, 32), (8, 32), (32, 32), (1, 256), (8, 256))
LIMIT_TOPK = 3
SERVER_TIMING = re.compile(rb"server-timing: total;dur=([0-9.]+)")
# the bench measures searching: hdr serve's result cache would answer the repeated bodies
# from memory, so it is off unless a cache.* setting is given (bench/search_cache.py
# measures the cache)
NO_CACHE = "cache.enabled=false"


class RawClient:
    """A minimal keep-alive HTTP/1.1 client on asyncio streams: the cheapest load generator
    we can write in Python, so the client takes as little of the 2 cores as possible (httpx
    spends about 1 ms a request). Reads Content-Length bodies only (both servers send them)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes, float | None]:
        """(status, body, the server's own milliseconds from its Server-Timing header)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.get_extra_info("socket").setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
            )
        assert self.reader is not None
        self.writer.write(
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), len(body), body)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        at = lower.index(b"content-length:") + 15
        length = int(lower[at : lower.index(b"\r\n", at)])
        data = await self.reader.readexactly(length)
        if b"connection: close" in lower:
            self.close()
        timing = SERVER_TIMING.search(lower)
        return status, data, float(timing.group(1)) if timing else None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) process `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load_cell(
    url: str,
    bodies: list[bytes],
    per_request: int,
    clients: int,
    seconds: float,
    server_pid: int | None = None,
) -> dict:
    """`clients` closed-loop RawClients for `seconds` (after a short warm-up); every answer is
    checked to be a 200 whose `result` has one list per query. With `server_pid`, also the
    server's CPU milliseconds per request: on a shared machine wall time per request moves
    with the neighbours' load, CPU time per request much less."""
    host, port = url.removeprefix("http://").split(":")
    latencies: list[float] = []
    server_ms: list[float] = []
    errors = 0
    turn = 0

    async def one_client(client: RawClient, deadline: float, record: bool) -> None:
        nonlocal errors, turn
        while time.perf_counter() < deadline:
            body = bodies[turn % len(bodies)]
            turn += 1
            started = time.perf_counter()
            took = None
            try:
                status, data, took = await client.post("/retrieve", body)
                ok = status == 200 and len(json.loads(data)["result"]) == per_request
            except (OSError, ValueError, KeyError, asyncio.IncompleteReadError):
                client.close()
                ok = False
            if record:
                latencies.append(time.perf_counter() - started)
                errors += not ok
                if took is not None:
                    server_ms.append(took)

    pool = [RawClient(host, int(port)) for _ in range(clients)]
    warmup = time.perf_counter() + min(1.0, seconds / 4)
    await asyncio.gather(*(one_client(c, warmup, False) for c in pool))
    cpu_before = cpu_seconds(server_pid) if server_pid else 0.0
    started = time.perf_counter()
    await asyncio.gather(*(one_client(c, started + seconds, True) for c in pool))
    elapsed = time.perf_counter() - started
    cpu_used = cpu_seconds(server_pid) - cpu_before if server_pid else float("nan")
    for client in pool:
        client.close()
    result = {
        "requests": len(latencies),
        "errors": errors,
        "queries_per_s": round(len(latencies) * per_request / elapsed, 1),
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(1000 * quantile(latencies, 0.5), 2),
        "p99_ms": round(1000 * quantile(latencies, 0.99), 2),
        "server_cpu_ms_per_request": round(1000 * cpu_used / max(1, len(latencies)), 3),
    }
    if server_ms:  # the server's own view: arrival to the response's start
        result["server_p50_ms"] = round(quantile(server_ms, 0.5), 2)
        result["server_p99_ms"] = round(quantile(server_ms, 0.99), 2)
    return result


def quantile(values: list[float], q: float) -> float:
    """The q-quantile by rank (the value below which q of them lie); nan when empty."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def seconds_per_query(
    work: Callable[[list[str]], object], queries: list[str], batch: int, seconds: float
) -> tuple[float, float]:
    """Wall and CPU seconds (this process, all threads) per query of `work` (the encoder
    alone, or the encoder and the index search), on `batch` queries at a time."""
    work(queries[:batch])  # warm
    done, turn = 0, 0
    cpu_started = time.process_time()
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        lo = (turn * batch) % max(1, len(queries) - batch)
        work(queries[lo : lo + batch])
        done += batch
        turn += 1
    return (time.perf_counter() - started) / done, (time.process_time() - cpu_started) / done


def bare_app(documents: list[dict]):
    """A FastAPI endpoint of /retrieve's response shape that does no work: it parses the body
    to count the queries and answers pre-encoded JSON of `topk` fixed passages a query."""
    app = FastAPI()
    answers: dict[int, bytes] = {}
    scored = [{"document": doc, "score": 0.5} for doc in documents[:LIMIT_TOPK]]

    @app.post("/retrieve")
    async def retrieve(request: Request) -> Response:
        count = len(json.loads(await request.body())["queries"])
        if count not in answers:
            answers[count] = json.dumps({"result": [scored] * count}).encode()
        return Response(answers[count], media_type="application/json")

    return app


def serve_bare(port: int, index: Path) -> None:
    """Run `bare_app` on uvicorn as `hdr serve` runs (same loop and HTTP implementation)."""
    import numpy as np
    import uvicorn

    from retrieval_server.index.files import DocumentStore, validate_index

    files = validate_index(index)
    store = DocumentStore(files.corpus, np.load(index / "offsets.npy"))
    documents = [dict(store.get(row), id=str(store.get(row)["id"])) for row in range(3)]
    uvicorn.run(bare_app(documents), host="127.0.0.1", port=port, log_level="warning",
                access_log=False)  # fmt: skip


def start_bare(index: Path, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, __file__, "--serve-bare-port", str(port), "--index", str(index)]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            raise SystemExit(f"the bare endpoint exited with {process.returncode}; see {log}")
        try:
            body = {"queries": ["x"]}
            httpx.post(f"http://127.0.0.1:{port}/retrieve", json=body, timeout=2)
            return process
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                process.terminate()
                raise SystemExit(f"the bare endpoint did not come up; see {log}") from None
            time.sleep(0.3)


def start_search_r1(
    script: Path, model: Path, index: Path, port: int, log: Path
) -> subprocess.Popen:
    """Search-R1's `retrieval_server.py` (its file given by --search-r1; not part of hdr) on the
    same flat index and corpus, with the same MiniLM encoder. It listens on port 8000."""
    from retrieval_server.index.files import validate_index

    files = validate_index(index)
    command = [sys.executable, str(script), "--index_path", str(index / "dense.faiss"),
               "--corpus_path", str(files.corpus), "--topk", str(LIMIT_TOPK),
               "--retriever_name", "minilm", "--retriever_model", str(model)]  # fmt: skip
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while True:
        if process.poll() is not None:
            raise SystemExit(f"Search-R1's server exited with {process.returncode}; see {log}")
        try:
            body = {"queries": ["x"], "topk": LIMIT_TOPK, "return_scores": True}
            httpx.post(f"http://127.0.0.1:{port}/retrieve", json=body, timeout=5)
            return process
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                process.terminate()
                raise SystemExit(f"Search-R1's server did not come up; see {log}") from None
            time.sleep(1)


def request_bodies(queries: list[str], per_request: int, count: int = 64) -> list[bytes]:
    bodies = []
    for i in range(count):
        batch = [queries[(i * per_request + j) % len(queries)] for j in range(per_request)]
        body = {"queries": batch, "topk": LIMIT_TOPK, "return_scores": True}
        bodies.append(json.dumps(body).encode())
    return bodies


def limit_table(
    index: Path,
    seconds: float,
    rounds: int,
    out: Path,
    settings: list[str],
    search_r1: Path | None,
    search_r1_model: Path | None,
    console: Console,
    cells: tuple[tuple[int, ...], ...] = LIMIT_CELLS,
) -> None:
    """Each cell in turn: the encoder alone, the bare endpoint, hdr serve (and Search-R1's
    server), `rounds` times; hdr's q/s and p99 as ratios to the limit the first two imply."""
    from core.config import load_config
    from retrieval_server.config import ServerConfig
    from retrieval_server.index.files import load_index
    from retrieval_server.serving.retrievers import DenseRetriever

    load_before = list(os.getloadavg())
    # the encoder and the index search run in this process as the server's do (its
    # encoder.* and dense.* settings included)
    own = [s for s in settings if s.startswith(("encoder.", "dense."))]
    config = load_config(ServerConfig, None, [f"index_dir={index}", *own])
    retriever = DenseRetriever(load_index(index, dense=config.dense, with_bm25=False), config)
    encoder = retriever.encoder
    queries = benchmark_queries()
    logs = Path(tempfile.mkdtemp(prefix="hdr-bench-limit-"))
    servers = {"bare": free_port(), "hdr": free_port()}
    processes = {
        "bare": start_bare(index, servers["bare"], logs / "bare.log"),
        "hdr": start_server(index, servers["hdr"], logs / "hdr.log", settings),
    }
    if search_r1 is not None:
        if search_r1_model is None:
            raise SystemExit("--search-r1 needs --search-r1-model (the MiniLM model directory)")
        servers["search_r1"] = 8000
        processes["search_r1"] = start_search_r1(
            search_r1, search_r1_model, index, 8000, logs / "search_r1.log"
        )
    console.print(f"limit cells: servers up (logs in {logs})")
    samples: dict[tuple[int, int], dict[str, list]] = {}
    try:
        for _ in range(rounds):
            for clients, per_request in cells:
                cell = samples.setdefault((clients, per_request), {})
                batch = min(clients * per_request, 256)
                encode_s, encode_cpu_s = seconds_per_query(
                    encoder.encode_queries, queries, batch, seconds / 2
                )
                cell.setdefault("encode_s", []).append(encode_s)
                cell.setdefault("encode_cpu_s", []).append(encode_cpu_s)
                retrieve_s, _ = seconds_per_query(
                    lambda batch_queries: retriever.search(batch_queries, LIMIT_TOPK),
                    queries, batch, seconds / 2,
                )  # fmt: skip
                cell.setdefault("retrieve_s", []).append(retrieve_s)
                bodies = request_bodies(queries, per_request)
                for name, port in servers.items():
                    url = f"http://127.0.0.1:{port}"
                    pid = processes[name].pid
                    result = asyncio.run(load_cell(url, bodies, per_request, clients, seconds, pid))
                    cell.setdefault(name, []).append(result)
                console.print(clients, per_request, {k: v[-1] for k, v in cell.items()})
    finally:
        for process in processes.values():
            process.terminate()
            process.wait(timeout=60)
    rows = [limit_row(key, cell) for key, cell in samples.items()]
    report = {
        "command": "bench/retrieval.py --cells limit " + " ".join(sys.argv[1:]),
        "machine": machine_facts(
            load_before, note="client, servers and encoder share the machine's cores"
        ),
        "seconds_per_cell": seconds,
        "rounds": rounds,
        "server_settings": searching(settings),
        "rows": rows,
    }
    write_report(out, report)
    print_limit(rows, console)
    console.print(f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after; "
                  f"written to {out}")  # fmt: skip


TAIL_CLIENTS = 32
TAIL_TARGET = 2.0  # the server's own p99 at most this many times its p50


def tail_table(
    index: Path, seconds: float, rounds: int, out: Path, settings: list[str], console: Console
) -> None:
    """32 closed-loop clients of one dense query each, against the bare endpoint and then hdr
    serve, `rounds` times interleaved: each one's client-side p50/p99 and hdr's server-side
    p50/p99 (its Server-Timing: arrival to the response's start), against the target that
    the server's p99 be at most TAIL_TARGET x its p50; and what hdr's scheduling adds to the
    tail: the share of requests that missed a micro-batch started after they arrived."""
    load_before = list(os.getloadavg())
    queries = benchmark_queries()
    logs = Path(tempfile.mkdtemp(prefix="hdr-bench-tail-"))
    ports = {"bare": free_port(), "hdr": free_port()}
    processes = {
        "bare": start_bare(index, ports["bare"], logs / "bare.log"),
        "hdr": start_server(index, ports["hdr"], logs / "hdr.log", settings),
    }
    bodies = request_bodies(queries, 1, count=len(queries))
    samples: dict[str, list[dict]] = {"bare": [], "hdr": []}
    try:
        for round_ in range(rounds):
            for name, port in ports.items():
                url, pid = f"http://127.0.0.1:{port}", processes[name].pid
                before = fifo_counts(url) if name == "hdr" else {}
                cell = asyncio.run(load_cell(url, bodies, 1, TAIL_CLIENTS, seconds, pid))
                if name == "hdr":  # the warm-up's requests are in it too: shares, not counts
                    after = fifo_counts(url)
                    cell.update({key: after[key] - before[key] for key in after})
                samples[name].append(cell)
                console.print(f"round {round_ + 1} {name}: {cell}")
    finally:
        for process in processes.values():
            process.terminate()
            process.wait(timeout=60)
    rows = [tail_row(i, samples["bare"][i], samples["hdr"][i]) for i in range(rounds)]
    report = {
        "command": "bench/retrieval.py --cells tail " + " ".join(sys.argv[1:]),
        "machine": machine_facts(
            load_before, note="clients, servers and encoder share the machine's cores"
        ),
        "clients": TAIL_CLIENTS,
        "queries_per_request": 1,
        "seconds_per_cell": seconds,
        "rounds": rounds,
        "server_settings": searching(settings),
        "target_server_p99_over_p50": TAIL_TARGET,
        "rows": rows,
        "median": {
            key: statistics.median(row[key] for row in rows) for key in rows[0] if key != "round"
        },
    }
    write_report(out, report)
    print_tail(rows, report["median"], console)
    console.print(f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after; "
                  f"written to {out}")  # fmt: skip


def fifo_counts(url: str) -> dict[str, float]:
    """hdr serve's counts of requests, micro-batches and first-in-first-served misses."""
    names = {
        "requests_counted": 'hdr_retrieval_requests_total{endpoint="/retrieve",status="200"}',
        "batches": "hdr_retrieval_batches_total",
        "fifo_misses": "hdr_retrieval_fifo_misses_total",
    }
    text = httpx.get(f"{url}/metrics").text
    values = {}
    for key, name in names.items():
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        values[key] = float(match.group(1)) if match else 0.0
    return values


def tail_row(round_: int, bare: dict, hdr: dict) -> dict:
    if bare["errors"] or hdr["errors"]:
        raise SystemExit(f"round {round_ + 1}: requests failed (bare {bare}, hdr {hdr})")
    return {
        "round": round_ + 1,
        "bare_queries_per_s": bare["queries_per_s"],
        "bare_p50_ms": bare["p50_ms"],
        "bare_p99_ms": bare["p99_ms"],
        "hdr_queries_per_s": hdr["queries_per_s"],
        "hdr_p50_ms": hdr["p50_ms"],
        "hdr_p99_ms": hdr["p99_ms"],
        "hdr_server_p50_ms": hdr["server_p50_ms"],
        "hdr_server_p99_ms": hdr["server_p99_ms"],
        "hdr_server_p99_over_p50": round(hdr["server_p99_ms"] / hdr["server_p50_ms"], 2),
        "hdr_queries_per_batch": round(hdr["requests_counted"] / max(1, hdr["batches"]), 1),
        "hdr_fifo_miss_share": round(hdr["fifo_misses"] / max(1, hdr["requests_counted"]), 4),
    }


def print_tail(rows: list[dict], median: dict, console: Console) -> None:
    title = f"the tail at {TAIL_CLIENTS} clients x 1 query (dense, topk 3, no cache)"
    table = Table(title=title)
    columns = ["round", "bare q/s", "bare p50", "bare p99", "hdr q/s", "hdr p50", "hdr p99",
               "server p50", "server p99", f"server p99/p50 (<= {TAIL_TARGET:g})",
               "queries/batch", "FIFO misses"]  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for row in [*rows, {**median, "round": "median"}]:
        table.add_row(
            str(row["round"]), f"{row['bare_queries_per_s']:.0f}", f"{row['bare_p50_ms']:.1f}",
            f"{row['bare_p99_ms']:.1f}", f"{row['hdr_queries_per_s']:.0f}",
            f"{row['hdr_p50_ms']:.1f}", f"{row['hdr_p99_ms']:.1f}",
            f"{row['hdr_server_p50_ms']:.1f}", f"{row['hdr_server_p99_ms']:.1f}",
            f"{row['hdr_server_p99_over_p50']:.2f}", f"{row['hdr_queries_per_batch']:.1f}",
            f"{row['hdr_fifo_miss_share']:.2%}",
        )  # fmt: skip
    console.print(table)


def machine_facts(load_before: list[float], **facts) -> dict:
    """The machine a report was measured on: cores and load average around the run."""
    return {
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": list(os.getloadavg()),
        **facts,
    }


def write_report(out: Path, report: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def limit_row(key: tuple[int, int], cell: dict[str, list]) -> dict:
    """Medians over rounds, and the limit: a request costs the bare endpoint's time plus its
    queries' encoding (at the batch size the clients' queries allow, at most 256), both on the
    same cores, so limit q/s = n / (1 / bare requests/s + n x encode seconds per query) and the
    limit p99 = bare p99 + the encoding of one batch of all clients' queries."""
    clients, per_request = key

    def median(name: str, field: str) -> float:
        return statistics.median(result[field] for result in cell[name])

    encode_s = statistics.median(cell["encode_s"])
    if any(result["errors"] for result in cell["bare"]):
        raise SystemExit(f"the bare endpoint failed requests in cell {key}: no limit to report")
    bare_rps = median("bare", "requests_per_s")
    limit_qps = per_request / (1 / bare_rps + per_request * encode_s)
    limit_p99 = median("bare", "p99_ms") + 1000 * clients * per_request * encode_s
    row = {
        "clients": clients,
        "queries_per_request": per_request,
        "encoder_queries_per_s": round(1 / encode_s, 1),
        "bare_requests_per_s": bare_rps,
        "bare_p99_ms": median("bare", "p99_ms"),
        "limit_queries_per_s": round(limit_qps, 1),
        "limit_p99_ms": round(limit_p99, 2),
        "hdr_queries_per_s": median("hdr", "queries_per_s"),
        "hdr_p50_ms": median("hdr", "p50_ms"),
        "hdr_p99_ms": median("hdr", "p99_ms"),
        "hdr_errors": sum(result["errors"] for result in cell["hdr"]),
    }
    # the same in CPU time, which the neighbours' load moves far less than wall time: what
    # one request costs the limit (bare endpoint + encoding) over what it costs hdr serve
    limit_cpu_ms = median("bare", "server_cpu_ms_per_request") + 1000 * per_request * (
        statistics.median(cell["encode_cpu_s"])
    )
    row["bare_cpu_ms_per_request"] = median("bare", "server_cpu_ms_per_request")
    row["limit_cpu_ms_per_request"] = round(limit_cpu_ms, 3)
    row["hdr_cpu_ms_per_request"] = median("hdr", "server_cpu_ms_per_request")
    row["hdr_cpu_ratio"] = round(limit_cpu_ms / row["hdr_cpu_ms_per_request"], 3)
    row["hdr_qps_ratio"] = round(row["hdr_queries_per_s"] / limit_qps, 3)
    # the limit again with the index search in it (encode + search alone, in this process):
    # what is left between it and hdr is hdr's own per-request path
    retrieve_s = statistics.median(cell["retrieve_s"])
    with_search = per_request / (1 / bare_rps + per_request * retrieve_s)
    row["retriever_queries_per_s"] = round(1 / retrieve_s, 1)
    row["limit_with_search_queries_per_s"] = round(with_search, 1)
    row["hdr_qps_ratio_with_search"] = round(row["hdr_queries_per_s"] / with_search, 3)
    row["hdr_p99_ratio"] = round(row["hdr_p99_ms"] / limit_p99, 3)
    if "search_r1" in cell:
        row["search_r1_queries_per_s"] = median("search_r1", "queries_per_s")
        row["search_r1_p99_ms"] = median("search_r1", "p99_ms")
        row["hdr_vs_search_r1_qps"] = round(
            row["hdr_queries_per_s"] / row["search_r1_queries_per_s"], 3
        )
        row["hdr_vs_search_r1_p99"] = round(row["hdr_p99_ms"] / row["search_r1_p99_ms"], 3)
        # each interleaved round's own ratio: the spread a single figure would hide
        row["hdr_vs_search_r1_qps_rounds"] = [
            round(h["queries_per_s"] / r["queries_per_s"], 3)
            for h, r in zip(cell["hdr"], cell["search_r1"], strict=True)
        ]
    return row


def spread(values: list[float] | None) -> list[float]:
    """The lowest and highest of a cell's per-round values (nothing when there are none)."""
    return [min(values), max(values)] if values else []


def print_limit(rows: list[dict], console: Console) -> None:
    table = Table(title="hdr serve against the limit (topk 3, return_scores, dense)")
    columns = ["clients x q/req", "encoder q/s", "bare req/s", "limit q/s", "hdr q/s", "ratio",
               "+ search: limit q/s", "ratio", "hdr p99 ms", "limit p99 ms", "p99 ratio",
               "CPU ms/req limit", "hdr", "CPU ratio"]  # fmt: skip
    with_r1 = any("search_r1_queries_per_s" in row for row in rows)
    if with_r1:
        columns += ["Search-R1 q/s", "hdr/SR1", "hdr/SR1 by round", "p99 hdr/SR1"]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        values = [
            f"{row['clients']} x {row['queries_per_request']}",
            f"{row['encoder_queries_per_s']:.0f}",
            f"{row['bare_requests_per_s']:.0f}",
            f"{row['limit_queries_per_s']:.0f}",
            f"{row['hdr_queries_per_s']:.0f}",
            f"{row['hdr_qps_ratio']:.2f}",
            f"{row['limit_with_search_queries_per_s']:.0f}",
            f"{row['hdr_qps_ratio_with_search']:.2f}",
            f"{row['hdr_p99_ms']:.1f}",
            f"{row['limit_p99_ms']:.1f}",
            f"{row['hdr_p99_ratio']:.2f}",
            f"{row['limit_cpu_ms_per_request']:.2f}",
            f"{row['hdr_cpu_ms_per_request']:.2f}",
            f"{row['hdr_cpu_ratio']:.2f}",
        ]
        if with_r1:
            values += [
                f"{row.get('search_r1_queries_per_s', float('nan')):.0f}",
                f"{row.get('hdr_vs_search_r1_qps', float('nan')):.2f}",
                "-".join(f"{r:.1f}" for r in spread(row.get("hdr_vs_search_r1_qps_rounds"))),
                f"{row.get('hdr_vs_search_r1_p99', float('nan')):.2f}",
            ]
        table.add_row(*values)
    console.print(table)


def main(
    index: Path = typer.Option(Path("data/index"), help="Index directory (embedded corpus)."),
    seconds: float = typer.Option(8.0, help="Measured seconds per cell (after a short warmup)."),
    out: Path = typer.Option(Path("bench/results/retrieval.json"), help="JSON results file."),
    settings: list[str] = typer.Option(
        [], "--set", help="Server setting key=value, e.g. --set batch_wait_ms=0 (repeatable)."
    ),
    cells: str = typer.Option(
        "all",
        help="normal (the concurrency table), overload, all (both), limit, or tail (32 clients: "
        "the server's own p50/p99 beside the client's and a bare endpoint's).",
    ),
    queue_bound: int = typer.Option(64, help="Overload cell: the server's max_queued_queries."),
    rounds: int = typer.Option(
        1, help="Limit and tail cells: interleaved rounds (medians reported)."
    ),
    limit_cells: str = typer.Option(
        ",".join(f"{c}x{n}" for c, n in LIMIT_CELLS),
        help="Limit cells to run, as CLIENTSxQUERIES, comma-separated (e.g. 1x1,32x1,1x32).",
    ),
    search_r1: Path | None = typer.Option(
        None, help="Limit cells: Search-R1's retrieval_server.py, to compare (not shipped)."
    ),
    search_r1_model: Path | None = typer.Option(
        None, help="Limit cells: the MiniLM model directory Search-R1's server loads."
    ),
    serve_bare_port: int | None = typer.Option(None, hidden=True),
) -> None:
    if serve_bare_port is not None:  # the bench's own subprocess: the bare endpoint
        serve_bare(serve_bare_port, index)
        return
    console = Console(width=max(Console().width, 150))  # the limit table has 9-12 columns
    if cells == "tail":
        tail_out = out.with_name("retrieval_tail.json") if out.name == "retrieval.json" else out
        tail_table(index, seconds, rounds, tail_out, settings, console)
        return
    if cells == "limit":
        limit_out = out.with_name("retrieval_limit.json") if out.name == "retrieval.json" else out
        try:
            shapes = [tuple(int(n) for n in cell.split("x")) for cell in limit_cells.split(",")]
        except ValueError:
            raise typer.BadParameter("--limit-cells: CLIENTSxQUERIES, e.g. 1x1,32x1") from None
        limit_table(index, seconds, rounds, limit_out, settings, search_r1, search_r1_model,
                    console, tuple(shapes))  # fmt: skip
        return
    if cells not in ("normal", "overload", "all"):
        raise typer.BadParameter("--cells must be normal, overload, all or limit")
    passed = True
    if cells in ("normal", "all"):
        passed = concurrency_table(index, seconds, out, settings, console)
    if cells in ("overload", "all"):
        cell = overload(index, queue_bound, settings, console)
        cell["machine"] = {"cpus": os.cpu_count(), "load_average_after": list(os.getloadavg())}
        overload_out = out.with_name("retrieval_overload.json")
        overload_out.parent.mkdir(parents=True, exist_ok=True)
        overload_out.write_text(json.dumps(cell, indent=2) + "\n")
        print_overload(cell, console)
        console.print(f"written to {overload_out}")
        passed = passed and cell["other_errors"] == 0 and cell["server_5xx_other_than_503"] == 0
    if not passed:
        raise typer.Exit(1)


def concurrency_table(
    index: Path, seconds: float, out: Path, settings: list[str], console: Console
) -> bool:
    """The retriever x request shape x concurrency table; returns whether the target is met."""
    load_before = list(os.getloadavg())
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="hdr-bench-server-", suffix=".log")[1])
    console.print(f"starting hdr serve on {index} (log: {log})")
    server = start_server(index, port, log, settings)
    url = f"http://127.0.0.1:{port}"
    try:
        health = httpx.get(f"{url}/health").json()
        queries = benchmark_queries()
        results = []
        for retriever in RETRIEVERS:
            for per_request in QUERIES_PER_REQUEST:
                for clients in CONCURRENCY:
                    cell = asyncio.run(
                        run_cell(url, queries, retriever, per_request, clients, seconds)
                    )
                    console.print(cell)
                    results.append(cell)
    finally:
        server.terminate()
        server.wait(timeout=60)

    qps = dense_single_query_qps(results)
    errors = sum(r["errors"] for r in results)
    passed = all(qps[clients] >= target for clients, target in TARGET_QPS.items()) and not errors
    report = {
        "index": {key: health[key] for key in ("documents", "encoder", "index_type")},
        "machine": machine_facts(load_before, python=platform.python_version()),
        "seconds_per_cell": seconds,
        "server_settings": searching(settings),
        "results": results,
        "target": {
            "dense_1_query_qps": qps,
            "required": TARGET_QPS,
            "errors": errors,
            "passed": passed,
        },
    }
    write_report(out, report)
    print_table(results, console)
    verdict = "PASS" if passed else "FAIL"
    console.print(
        f"{verdict}: dense, 1 query/request: {qps[1]:.0f} q/s with 1 client (target >= "
        f"{TARGET_QPS[1]:.0f}), {qps[32]:.0f} with 32 (target >= {TARGET_QPS[32]:.0f}); "
        f"{errors} errors; load average {load_before[0]:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after; written to {out}"
    )
    return passed


if __name__ == "__main__":
    typer.run(main)
