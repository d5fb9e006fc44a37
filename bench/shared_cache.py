"""Two `hdr serve` replicas in front of one paid search API: what the fleet pays with a cache per
replica, with one cache shared in Redis (`cache.backend: redis`), with hdr's client hashing
each query to one replica (`retrieval.routing: hash`), and with a single server; a shared hit's
latency beside a local one's; and a fault run, Redis stopped and started again mid-run.

**The API** is an `hdr serve` on the BM25 index that charges an emulated 50 ms a call and has
no cache of its own, so its own counter (`hdr_retrieval_queries_total`) says how many calls
reached it: the billed calls. The replicas are proxies of it (`hdr serve --upstream`), fresh
for every setup; the client is hdr's own (`agent_env.retrieval_client`).

**The traffic** is the CPU bed's training searches (configs/tiny-cpu.yaml: 16 prompts x 8
responses a step, one BM25 search a response), 60 steps:

- `--queries FILE`: a query log that `hdr serve query_log=FILE` wrote during a bed run (as
  bench/search_cache.py does, runs/bench-search-cache/seed0-cache-on.queries.jsonl): the
  recorded searches, one request a step;
- without it, modelled: the run's prompts exactly as the trainer draws them (seed 0,
  `trainer.fresh.sample_prompts` over the bed's question pool), and each response's search the
  question itself with probability 7/8, else a copy with one of its words dropped, the rate at
  which the SFT start repeated in its recorded run (bench/results/search_cache.json: 25.0% of
  its searches the first of their key, 74.9% repeats inside their group). Two pools: the bed's
  8,139 training questions (60 steps draw 960 of them, no repeat across steps) and 480 of them
  (`data.train_questions=480`: the 60 steps are two epochs).

**Two request shapes**: `step`, one request a step with its 128 searches, split by the client
into one chunk per replica (hdr's trainer); `search`, one request a search, the step's 128 in
flight together (veRL's tool, or a load balancer in front of the replicas; the client with
`max_batch_queries=1`, rotating over the replicas per request).

**Latency** (one client, one query a request, 200 distinct queries): a miss (the API's 50 ms),
a shared hit (the other replica's answer, read from Redis) and a local hit.

**The fault run**: two replicas sharing Redis (append-only file, fsync always) and a budget of
the traffic's distinct queries plus 5% (`upstream.max_calls`, the fleet's, in Redis), `search`
shape on the 480-question pool; Redis is stopped 2 s into the run and started again 3 s later.
While it is down the budget refuses misses (503, Retry-After 1) and the client retries (up to
30 times, 1 s apart at most). Counted: failed searches (after the client's retries), the 503s,
the calls the API received beside the budget and the fleet's billed count.

    .venv/bin/python bench/shared_cache.py --index data/index   # 10-30 minutes, 2 shared cores
    # writes bench/results/shared_cache.json and prints the tables

The index needs BM25 only (`hdr index build --no-dense` builds it in seconds).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path[1:1] = [str(ROOT / "tests"), str(ROOT / "tests" / "retrieval_server")]
from redis_servers import RedisServer  # noqa: E402  (tests/retrieval_server: real redis-server)
from retrieval import free_port, machine_facts, quantile, start_server  # noqa: E402
from search_cache import timed_requests  # noqa: E402

CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
STEPS, PROMPTS, GROUP = 60, 16, 8  # configs/tiny-cpu.yaml's batch; 60 of its 120 steps
COPY_PROBABILITY = 7 / 8  # the SFT start's searches: 25.0% first of their key
SMALL_POOL = 480
EMULATED_MS = 50.0
PROBE_QUERIES = 200
SETUPS = ("one server", "two, own caches", "two, shared Redis", "two, hash routing")
SHAPES = ("step", "search")


# --- traffic ---------------------------------------------------------------------------------


def modelled_traffic(pool: int | None, steps: int, seed: int = 0) -> list[list[str]]:
    """The bed's searches, step by step: its prompts as the trainer draws them, each response
    the question itself (COPY_PROBABILITY) or the question with one word dropped."""
    from agent_env.data import load_questions
    from core.config import load_config
    from trainer.config import TrainConfig
    from trainer.fresh import sample_prompts

    config = load_config(TrainConfig, CONFIG, [f"data.train_questions={pool or 'null'}"])
    questions = load_questions(config.data, seed, 0)[0]
    rng = random.Random(seed)
    traffic = []
    for step in range(1, steps + 1):
        searches = []
        for example in sample_prompts(questions, seed, step, PROMPTS):
            for _ in range(GROUP):
                words = example.question.split()
                if rng.random() >= COPY_PROBABILITY and len(words) > 1:
                    del words[rng.randrange(len(words))]
                searches.append(" ".join(words))
        traffic.append(searches)
    return traffic


def recorded_traffic(path: Path) -> list[list[str]]:
    """The queries of each request of a query log (one request a step)."""
    return [json.loads(line)["queries"] for line in path.read_text().splitlines() if line]


# --- servers -----------------------------------------------------------------------------------


def searched(url: str) -> int:
    """Queries the API has searched (its own counter)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return int(
        sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("hdr_retrieval_queries_total")
        )
    )


@contextmanager
def replicas(api: str, count: int, work: Path, settings: list[str], logs: list[Path] | None = None):
    """`count` fresh proxies of the API with `settings`; yields their URLs (their logs are
    added to `logs`)."""
    processes, urls = [], []
    try:
        for _ in range(count):
            port = free_port()
            log = work / f"replica-{len(list(work.glob('replica-*.log')))}.log"
            # a replica of a budgeted fleet keeps its own record of the fleet's budget
            budgeted = any(setting.startswith("upstream.max_calls=") for setting in settings)
            record = [f"upstream.spend_path={log.with_suffix('.record.json')}"] if budgeted else []
            processes.append(
                start_server(
                    None, port, log, ["cache.enabled=true", *settings, *record], upstream=api
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
            if logs is not None:
                logs.append(log)
        yield urls
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=60)


def client_config(urls: list[str], shape: str, routing: str, patient: bool = False):
    from agent_env.retrieval_client import RetrievalConfig

    return RetrievalConfig(
        urls=urls,
        topk=3,
        retriever="bm25",
        routing=routing,
        max_batch_queries=1 if shape == "search" else 512,
        max_connections=128,
        max_retries=30 if patient else 4,
        backoff_max_s=1.0 if patient else 8.0,
    )


def replay(urls: list[str], steps: list[list[str]], shape: str, routing: str, **patient):
    """Every step's searches through hdr's client; (its stats, seconds)."""
    from agent_env.retrieval_client import RetrievalClient

    started = time.perf_counter()
    with RetrievalClient(client_config(urls, shape, routing, **patient), seed=0) as client:
        for searches in steps:
            client.search_each(searches)
        return client.stats, time.perf_counter() - started


def billed_run(
    api: str, redis: RedisServer, steps: list[list[str]], shape: str, setup: str, work: Path
) -> dict:
    """One setup on one traffic and shape: what the API received, and the client's view."""
    count = 1 if setup == "one server" else 2
    settings = []
    if setup == "two, shared Redis":
        settings = ["cache.backend=redis", f"cache.redis_url={redis.url}",
                    f"cache.redis_namespace=bench-{time.monotonic_ns()}"]  # fmt: skip
    routing = "hash" if setup == "two, hash routing" else "rotate"
    logs: list[Path] = []
    with replicas(api, count, work, settings, logs) as urls:
        before = searched(api)
        stats, wall = replay(urls, steps, shape, routing)
        calls = searched(api) - before
        reports = [httpx.get(f"{url}/health").json() for url in urls]
    searches = sum(len(s) for s in steps)
    # why the API may have received more than one call a distinct query: a replica that lost
    # Redis for a moment (a command past cache.redis_timeout_s) served alone meanwhile, a
    # forward the replica retried, a search the client retried on the other replica
    outages = sum(log.read_text().count(" unreachable (") for log in logs)
    return {
        "setup": setup,
        "shape": shape,
        "searches": searches,
        "distinct": len({q for s in steps for q in s}),
        "api_calls": calls,
        "billed_per_search": round(calls / searches, 4),
        "client_billed": stats.billed_queries,
        "client_cached": stats.cached_queries,
        "failed": stats.failed_queries,
        "client_retries": stats.retries,
        "replica_retries": sum(r["upstream"]["retries"] for r in reports),
        "redis_outages": outages,
        "requests": stats.requests,
        "shared_hits": sum(r["cache"].get("shared_hits", 0) for r in reports),
        "shared_waits": sum(r["cache"].get("shared_waits", 0) for r in reports),
        "wall_s": round(wall, 1),
    }


# --- latency ---------------------------------------------------------------------------------


def timed(url: str, queries: list[str]) -> dict:
    """One client, one query a request, in turn (search_cache.py's probe): its quantiles."""
    client_ms, server_ms = asyncio.run(timed_requests(url, queries, "bm25"))
    return {
        "requests": len(queries),
        "client_p50_ms": round(quantile(client_ms, 0.5), 3),
        "client_p99_ms": round(quantile(client_ms, 0.99), 3),
        "server_p50_ms": round(quantile(server_ms, 0.5), 3),
        "server_p99_ms": round(quantile(server_ms, 0.99), 3),
    }


def latency(api: str, redis: RedisServer, queries: list[str], work: Path) -> dict:
    """A miss on one replica, then the same queries on the other (shared hits), then there
    again (local hits)."""
    settings = ["cache.backend=redis", f"cache.redis_url={redis.url}",
                "cache.redis_namespace=bench-latency"]  # fmt: skip
    with replicas(api, 2, work, settings) as (first, second):
        timed(first, ["warm-up query"])
        timed(second, ["warm-up query"])
        out = {
            "miss": timed(first, queries),
            "shared hit": timed(second, queries),
            "local hit": timed(second, queries),
        }
        cache = httpx.get(f"{second}/health").json()["cache"]
    if cache["shared_hits"] < len(queries) or cache["hits"] < 2 * len(queries):
        raise SystemExit(f"the latency probe's hits are not what it asked: {cache}")
    return out


# --- the fault run -----------------------------------------------------------------------------


def fault_run(api: str, steps: list[list[str]], work: Path) -> dict:
    """Two replicas sharing a persistent Redis and a budget; Redis stopped and started again
    while the client replays the traffic."""
    redis = RedisServer(work / "redis-fault", persist=True)
    redis.start()
    distinct = len({q for s in steps for q in s})
    budget = math.ceil(distinct * 1.05)
    settings = ["cache.backend=redis", f"cache.redis_url={redis.url}",
                f"upstream.max_calls={budget}", "upstream.max_retries=0"]  # fmt: skip
    events: dict[str, float] = {}
    try:
        with replicas(api, 2, work, settings) as urls:
            before = searched(api)
            started = time.perf_counter()

            def stop_and_start() -> None:
                time.sleep(2.0)
                events["redis_stopped_at_s"] = round(time.perf_counter() - started, 2)
                redis.stop()
                time.sleep(3.0)
                redis.start()
                events["redis_started_at_s"] = round(time.perf_counter() - started, 2)

            fault = threading.Thread(target=stop_and_start)
            fault.start()
            stats, wall = replay(urls, steps, "search", "rotate", patient=True)
            fault.join()
            calls = searched(api) - before
            reports = [httpx.get(f"{url}/health").json() for url in urls]
            answered_503 = 'hdr_retrieval_requests_total{endpoint="/retrieve",status="503"}'
            refused = sum(
                float(line.split()[-1])
                for url in urls
                for line in httpx.get(f"{url}/metrics").text.splitlines()
                if line.startswith(answered_503)
            )
    finally:
        redis.kill()
    fleet = reports[0]["upstream"]
    return {
        "searches": sum(len(s) for s in steps),
        "distinct": distinct,
        "budget": budget,
        **events,
        "wall_s": round(wall, 1),
        "failed_searches": stats.failed_queries,
        "client_retries": stats.retries,
        "answered_503": int(refused),
        "api_calls": calls,
        "fleet_billed": fleet["calls"],
        "fleet_committed": fleet["committed_calls"],
        "both_replicas_agree": reports[0]["upstream"]["calls"] == reports[1]["upstream"]["calls"],
        "overspent": calls > budget,
        "billed_count_honest": fleet["calls"] == calls,
    }


# --- the report --------------------------------------------------------------------------------


def print_report(report: dict, console: Console) -> None:
    for traffic in report["traffic"].values():
        table = Table(title=f"billed calls, {traffic['description']}")
        for column in ("setup", "shape", "searches", "distinct", "API calls", "per search",
                       "shared hits", "waited on the other", "retries client/replica",
                       "Redis lost", "failed", "s"):  # fmt: skip
            table.add_column(column, justify="right")
        for run in traffic["runs"]:
            table.add_row(
                run["setup"], run["shape"], f"{run['searches']:,}", f"{run['distinct']:,}",
                f"{run['api_calls']:,}", f"{run['billed_per_search']:.3f}",
                f"{run['shared_hits']:,}", f"{run['shared_waits']:,}",
                f"{run['client_retries']}/{run['replica_retries']}", str(run["redis_outages"]),
                str(run["failed"]), f"{run['wall_s']:.0f}",
            )  # fmt: skip
        console.print(table)
    probe = Table(title=f"latency, one client, {PROBE_QUERIES} requests of one query (ms)")
    for column in ("case", "client p50", "client p99", "server p50", "server p99"):
        probe.add_column(column, justify="right")
    keys = ("client_p50_ms", "client_p99_ms", "server_p50_ms", "server_p99_ms")
    for case, row in report["latency"].items():
        probe.add_row(case, *(f"{row[k]:.2f}" for k in keys))
    console.print(probe)
    f = report["fault"]
    console.print(
        f"fault run: Redis stopped at {f['redis_stopped_at_s']} s, started at"
        f" {f['redis_started_at_s']} s of {f['wall_s']} s; {f['searches']:,} searches,"
        f" {f['failed_searches']} failed, {f['answered_503']} answered 503 meanwhile"
        f" ({f['client_retries']} client retries); the API received {f['api_calls']:,} calls for"
        f" {f['distinct']:,} distinct queries on a budget of {f['budget']:,}; the fleet billed"
        f" {f['fleet_billed']:,} (overspent: {f['overspent']}, honest: {f['billed_count_honest']})"
    )


def main(
    index: Path = typer.Option(Path("data/index"), help="The embedded corpus's index (BM25)."),
    queries: Path | None = typer.Option(
        None, help="A query log of a bed run (hdr serve query_log=...) to replay instead."
    ),
    work: Path = typer.Option(Path("runs/bench-shared-cache"), help="Servers' logs, Redis."),
    out: Path = typer.Option(Path("bench/results/shared_cache.json"), help="JSON results."),
    steps: int = typer.Option(STEPS, min=1, help="Training steps of traffic replayed."),
) -> None:
    from core.paths import write_text_atomic

    console = Console(width=max(Console().width, 150))
    load_before = list(os.getloadavg())
    work.mkdir(parents=True, exist_ok=True)
    if queries is not None:
        recorded = recorded_traffic(queries)[:steps]
        traffic = {"recorded": (f"the recorded searches of {queries}", recorded)}
    else:
        traffic = {
            "bed": ("the bed's 8,139 training questions, modelled", modelled_traffic(None, steps)),
            "pool480": (
                f"a pool of {SMALL_POOL} questions (two epochs in 60 steps), modelled",
                modelled_traffic(SMALL_POOL, steps),
            ),
        }
    api_port = free_port()
    api_settings = ["cache.enabled=false", f"emulated_cost.request_latency_ms={EMULATED_MS}"]
    api = start_server(index, api_port, work / "api.log", [*api_settings, "default_retriever=bm25"])
    api_url = f"http://127.0.0.1:{api_port}"
    redis = RedisServer(work / "redis", persist=False)
    report: dict = {
        "command": "bench/shared_cache.py " + " ".join(sys.argv[1:]),
        "api_emulated_ms_per_call": EMULATED_MS,
        "copy_probability": COPY_PROBABILITY if queries is None else None,
        "traffic": {},
    }
    try:
        redis.start()
        for name, (description, steps) in traffic.items():
            runs = []
            for shape in SHAPES:
                for setup in SETUPS:
                    console.print(f"{name}: {setup}, {shape} requests")
                    runs.append(billed_run(api_url, redis, steps, shape, setup, work))
            report["traffic"][name] = {"description": description, "runs": runs}
        probe = list(dict.fromkeys(q for s in next(iter(traffic.values()))[1] for q in s))
        console.print("latency probe")
        report["latency"] = latency(api_url, redis, probe[:PROBE_QUERIES], work)
        console.print("fault run")
        fault_steps = traffic.get("pool480", next(iter(traffic.values())))[1]
        report["fault"] = fault_run(api_url, fault_steps, work)
    finally:
        redis.kill()
        api.terminate()
        api.wait(timeout=60)
    report["machine"] = machine_facts(
        load_before, note="the API, the replicas, Redis and the client share the cores"
    )
    write_text_atomic(out, json.dumps(report, indent=2) + "\n")
    print_report(report, console)
    console.print(f"written to {out}")


if __name__ == "__main__":
    typer.run(main)
