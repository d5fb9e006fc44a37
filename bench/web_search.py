"""What live web search costs a training run, and what hdr saves: billed calls, fees and step
time of the CPU bed's search traffic against a web search API that answers in 800 ms and
charges per call, with no cache, with hdr's cache, with two replicas sharing one cache in
Redis, and an evaluation rerun from the snapshot the cached run recorded.

**The API** is the fake Serper of the tests (`tests/retrieval_server/fake_web_search.py`, real
uvicorn on 127.0.0.1): Serper's request and answer shapes, `--latency-ms` (800) before every
answer, its own count of the searches it answered: the billed calls, at `--price` dollars each
(0.001: Serper's price per search on its smallest plans, as published when this was written).
The servers are `hdr serve --web serper` (in-process uvicorn, `upstream.max_concurrency` 16),
fresh for every setup.

**The traffic** is bench/shared_cache.py's model of the CPU bed's training searches
(configs/tiny-cpu.yaml: 16 prompts x 8 responses a step, each response's search the question
itself with probability 7/8, else a copy with one word dropped), on the 480-question pool, one
request a step with its 128 searches (hdr's trainer); with two replicas the step is split in
two halves sent together, one to each.

**Setups**: `no cache` (`cache.enabled=false`: every search a call); `local cache` (one server,
hdr's default cache, which also records the run's snapshot); `two replicas, Redis` (a fresh
`redis-server`, `cache.backend=redis`); `snapshot rerun` (`hdr serve --snapshot` on the
recording, the same traffic: what an evaluation rerun pays, and whether every response is byte
for byte the recorded one).

    .venv/bin/python bench/web_search.py            # about 4 minutes at 20 steps
    # writes bench/results/web_search.json and prints the table
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
# hdr's packages first: tests/ holds folders of the same names (without __init__.py)
sys.path[0:0] = [str(ROOT), str(Path(__file__).parent), str(ROOT / "tests"),
                 str(ROOT / "tests" / "retrieval_server")]  # fmt: skip
from fake_web_search import fake_web_search  # noqa: E402  (tests/retrieval_server)
from redis_servers import redis_server  # noqa: E402
from retrieval import machine_facts, write_report  # noqa: E402
from servers import running_server  # noqa: E402
from shared_cache import SMALL_POOL, modelled_traffic  # noqa: E402

TOPK = 3
SETUPS = ("no cache", "local cache", "two replicas, Redis", "snapshot rerun")


async def send_step(client: httpx.AsyncClient, urls: list[str], searches: list[str]) -> list:
    """One step's searches, split evenly over `urls` and sent together; the response bodies."""
    size = -(-len(searches) // len(urls))
    parts = [searches[i * size : (i + 1) * size] for i in range(len(urls))]
    responses = await asyncio.gather(
        *(
            client.post(f"{url}/retrieve", json={"queries": part, "topk": TOPK})
            for url, part in zip(urls, parts, strict=True)
            if part
        )
    )
    for response in responses:
        response.raise_for_status()
    return [response.content for response in responses]


def replay(urls: list[str], steps: list[list[str]]) -> tuple[list[float], list[bytes]]:
    """Every step in order; each step's seconds and every response body."""

    async def run() -> tuple[list[float], list[bytes]]:
        times, bodies = [], []
        async with httpx.AsyncClient(timeout=600) as client:
            for searches in steps:
                started = time.perf_counter()
                bodies += await send_step(client, urls, searches)
                times.append(time.perf_counter() - started)
        return times, bodies

    return asyncio.run(run())


def row(setup: str, fake, before: int, times: list[float], steps, price: float) -> dict:
    billed = fake.answered - before
    searches = sum(len(step) for step in steps)
    return {
        "setup": setup,
        "searches": searches,
        "distinct": len({query for step in steps for query in step}),
        "billed_calls": billed,
        "fees_usd": round(billed * price, 6),
        "billed_per_search": round(billed / searches, 4),
        "step_s_mean": round(sum(times) / len(times), 3),
        "step_s_first": round(times[0], 3),
        "step_s_last": round(times[-1], 3),
        "wall_s": round(sum(times), 1),
    }


def measure(steps: list[list[str]], latency_ms: float, price: float, work: Path) -> list[dict]:
    """The four setups on one fake API; their rows."""
    web = {"web": {"api": "serper"}, "price_per_call": price, "max_concurrency": 16}
    snapshot_path = work / "run.snapshot"
    rows = []
    with fake_web_search("serper", latency_s=latency_ms / 1000) as fake:
        os.environ["SERPER_API_KEY"] = fake.key
        upstream = {**web, "url": fake.url}
        before = fake.answered
        with running_server(None, upstream=upstream, cache={"enabled": False}) as server:
            times, _ = replay([server.url], steps)
        rows.append(row("no cache", fake, before, times, steps, price))
        before = fake.answered
        record = {"record_path": snapshot_path}
        with running_server(None, upstream=upstream, snapshot=record) as server:
            times, recorded = replay([server.url], steps)
        rows.append(row("local cache", fake, before, times, steps, price))
        before = fake.answered
        with redis_server(work / "redis") as redis:
            fleet = {"backend": "redis", "redis_url": redis.url}
            with (
                running_server(None, upstream=upstream, cache=fleet) as one,
                running_server(None, upstream=upstream, cache=fleet) as two,
            ):
                times, _ = replay([one.url, two.url], steps)
        rows.append(row("two replicas, Redis", fake, before, times, steps, price))
        before = fake.answered
        with running_server(None, snapshot={"path": snapshot_path}) as server:
            times, replayed = replay([server.url], steps)
        rerun = row("snapshot rerun", fake, before, times, steps, price)
        rerun["bytes_identical"] = replayed == recorded
        rerun["snapshot_bytes"] = snapshot_path.stat().st_size
        rows.append(rerun)
    return rows


def print_report(report: dict, console: Console) -> None:
    table = Table(
        title=f"web search, {report['latency_ms']:g} ms a call, ${report['price_usd']:g} a call, "
        f"{report['steps']} steps of {report['searches_per_step']} searches"
    )
    for column in ("setup", "searches", "distinct", "billed calls", "fees $", "per search",
                   "step s (mean)", "first", "last", "wall s"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in report["runs"]:
        table.add_row(
            r["setup"], f"{r['searches']:,}", f"{r['distinct']:,}", f"{r['billed_calls']:,}",
            f"{r['fees_usd']:.3f}", f"{r['billed_per_search']:.3f}", f"{r['step_s_mean']:.2f}",
            f"{r['step_s_first']:.2f}", f"{r['step_s_last']:.2f}", f"{r['wall_s']:.0f}",
        )  # fmt: skip
    console.print(table)
    rerun = report["runs"][-1]
    console.print(
        f"snapshot rerun: {rerun['billed_calls']} billed, every response byte for byte the "
        f"recorded one: {rerun['bytes_identical']} (snapshot {rerun['snapshot_bytes']:,} bytes)"
    )


def main(
    steps: int = typer.Option(20, "--steps", min=1, help="Training steps of traffic."),
    latency_ms: float = typer.Option(800.0, "--latency-ms", min=0, help="The API's latency."),
    price: float = typer.Option(0.001, "--price", min=0, help="Dollars per billed call."),
    out: Path = typer.Option(ROOT / "bench" / "results" / "web_search.json", "--out"),
) -> None:
    load_before = list(os.getloadavg())
    traffic = modelled_traffic(SMALL_POOL, steps)
    with tempfile.TemporaryDirectory() as work:
        runs = measure(traffic, latency_ms, price, Path(work))
    report = {
        "bench": "web_search",
        "command": f"bench/web_search.py --steps {steps} --latency-ms {latency_ms:g} "
        f"--price {price:g}",
        "latency_ms": latency_ms,
        "price_usd": price,
        "steps": steps,
        "searches_per_step": len(traffic[0]),
        "question_pool": SMALL_POOL,
        "runs": runs,
        "machine": machine_facts(load_before),
    }
    write_report(out, report)
    print_report(report, Console())
    print(f"wrote {out}")
    json.dumps(report)  # the report is plain JSON


if __name__ == "__main__":
    typer.run(main)
