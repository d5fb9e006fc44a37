"""What a flat FAISS search costs beside the encoder: FAISS's per-query SIMD scan against one
BLAS product by batch size (`dense.blas_from_queries`), a lone query's scan with the vectors in
the cache and right after an encoder pass, and the encoder called directly and through
`asyncio.to_thread` (the server's hand-off). One thread for FAISS, in this process.

    # writes bench/results/faiss_flat.json
    .venv/bin/python bench/probes/faiss_flat.py --index data/index
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `hdr serve` sets it

import faiss
import typer
from retrieval import benchmark_queries
from rich.console import Console
from rich.table import Table

from retrieval_server.index.encoder import Encoder
from retrieval_server.index.files import DENSE_FILE, read_dense, read_manifest

BATCHES = (1, 4, 32, 256)


def ms_per_call(work: Callable[[], object], seconds: float) -> float:
    work()  # warm
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        work()
        calls += 1
    return 1000 * (time.perf_counter() - started) / calls


def main(
    index: Path = typer.Option(Path("data/index"), help="Index directory with a flat dense.faiss."),
    seconds: float = typer.Option(2.0, help="Seconds per measurement."),
    out: Path = typer.Option(Path("bench/results/faiss_flat.json"), help="JSON results file."),
) -> None:
    dense = read_dense(index / DENSE_FILE, mmap=True)
    encoder = Encoder(read_manifest(index).encoder)
    queries = benchmark_queries()
    vectors = encoder.encode_queries(queries[: max(BATCHES)])
    faiss.omp_set_num_threads(1)
    own_threshold = faiss.cvar.distance_compute_blas_threshold
    rows = []
    for batch in BATCHES:
        row = {"queries": batch}
        for name, threshold in (("scan_ms", 2**31 - 1), ("blas_ms", 1)):
            faiss.cvar.distance_compute_blas_threshold = threshold
            row[name] = round(ms_per_call(lambda n=batch: dense.search(vectors[:n], 3), seconds), 3)
        rows.append(row)
    faiss.cvar.distance_compute_blas_threshold = own_threshold  # a lone query: the scan

    turn = iter(range(10**9))

    def encode_then_search() -> None:
        i = next(turn) % len(queries)
        dense.search(encoder.encode_queries([queries[i]]), 3)

    def encode_alone() -> None:
        encoder.encode_queries([queries[next(turn) % len(queries)]])

    async def through_thread(calls: int = 500) -> float:
        await asyncio.to_thread(encode_alone)
        started = time.perf_counter()
        for _ in range(calls):
            await asyncio.to_thread(encode_alone)
        return 1000 * (time.perf_counter() - started) / calls

    encode_ms = ms_per_call(encode_alone, seconds)
    lone = {
        "search_hot_ms": round(ms_per_call(lambda: dense.search(vectors[:1], 3), seconds), 3),
        "encode_ms": round(encode_ms, 3),
        "encode_then_search_ms": round(ms_per_call(encode_then_search, seconds), 3),
        "encode_through_to_thread_ms": round(asyncio.run(through_thread()), 3),
    }
    lone["search_after_encode_ms"] = round(lone["encode_then_search_ms"] - encode_ms, 3)
    report = {
        "command": "bench/probes/faiss_flat.py",
        "index": str(index),
        "vectors": [dense.ntotal, dense.d],
        "faiss": faiss.__version__,
        "faiss_own_blas_threshold": own_threshold,
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "batches": rows,
        "lone_query": lone,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    table = Table(title=f"flat search, {dense.ntotal} x {dense.d}, one thread (ms a call)")
    for column in ("queries", "SIMD scan", "BLAS product"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["queries"]), f"{row['scan_ms']:.2f}", f"{row['blas_ms']:.2f}")
    console = Console()
    console.print(table)
    console.print(lone)
    console.print(f"written to {out}")


if __name__ == "__main__":
    typer.run(main)
