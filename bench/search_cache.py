"""What the result cache saves on the CPU bed's training run, and that it changes nothing else.

For each seed, the bed's default training run (`configs/tiny-cpu.yaml`: 120 steps, 16 prompts
x 8 responses, one BM25 search a response) runs twice, each against its own `hdr serve`: with
the cache (the default) and without it (`cache.enabled=false`). The periodic held-out
evaluation is off (`eval.every=0 eval.at_start=false`; it runs under a forked RNG, so training
is the same with or without it), so every query the server logs (`query_log`) is a training
search: one request a step, the step's queries in trajectory order, G consecutive queries a
group. From the log of the run with the cache:

- **repeat shares**: each search is either the first of its key (retriever, topk, query) in
  the run, or a repeat of a search made earlier in its own group, else earlier in its step
  (another group), else in an earlier step of the same epoch, else in an earlier epoch (the
  run's prompts are epochs of permutations of the training questions; the default run's
  1,920 prompts are less than one epoch of 8,140, so that share is 0 there by construction);
- **billed calls per fresh rollout** with the cache (the server's X-HDR-Billed-Queries,
  summed) and without it (every query billed);
- **identical training**: both runs' metrics (every field but times and the ledger), groups
  log, final weights and last checkpoint's replay buffer (its token ids), bit for bit.

Then, on fresh servers: **hit and miss latency** (one client, one query a request, the client's
and the server's own time), the **cache's memory at the default size** (filled in this process
with answers of the bed's shape; tracemalloc against its own byte count), and a **proxy run**:
the logged requests replayed through `hdr serve --upstream` in front of a second `hdr serve`
that charges the emulated per-call cost (`emulated_cost.request_latency_ms`) and has no cache
of its own, so its own counters say how many calls reached it.

The tiny policy's repeats are its own: a real model (and the fidelity bed's random weights)
repeats differently, and that share is not measured here.

    .venv/bin/python bench/search_cache.py --index data/index --model data/tiny-sft --seeds 0,1
    # writes bench/results/search_cache.json; the runs go to runs/bench-search-cache/
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from retrieval import (
    HDR,
    RawClient,
    benchmark_queries,
    free_port,
    machine_facts,
    quantile,
    start_server,
    write_report,
)

CONFIG = Path("configs/tiny-cpu.yaml")
# what differs between two identical runs on one machine: wall and CPU time, and the ledger
# of what the server billed (the point of the cache)
NOT_COMPARED = ("time", "seconds", "_s", "cached", "billed", "throughput", "per_s")
KINDS = ("first", "within_group", "within_step", "across_steps", "across_epochs")
PROBE_QUERIES = 200
EMULATED_MS = 50.0  # the upstream's emulated cost per call in the proxy run


# --- the training runs -----------------------------------------------------------------------


def train_run(
    index: Path, model: Path, seed: int, cache: bool, work: Path, extra: list[str]
) -> Path:
    """One run of the bed's config against its own `hdr serve` (with or without the cache),
    its queries logged; skipped when its final model is there already (a resumed bench)."""
    name = f"seed{seed}-cache-{'on' if cache else 'off'}"
    run_dir, log = work / name, work / f"{name}.queries.jsonl"
    if (run_dir / "final").is_dir() and log.is_file():
        return run_dir
    if run_dir.exists() or log.exists():
        raise SystemExit(f"{run_dir} (or its query log) is from an unfinished run: remove both")
    port = free_port()
    # said either way: bench/retrieval.py's servers turn the cache off unless told
    settings = [f"query_log={log}", f"cache.enabled={'true' if cache else 'false'}"]
    server = start_server(index, port, work / f"{name}.server.log", settings)
    try:
        command = [HDR, "train", "--config", str(CONFIG), f"seed={seed}",
                   f"model.path={model}", f"retrieval.urls=[http://127.0.0.1:{port}]",
                   f"out_dir={run_dir}", "eval.every=0", "eval.at_start=false",
                   "log.progress=false", *extra]  # fmt: skip
        with (work / f"{name}.train.log").open("w") as out:
            subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=True, env=env())
    finally:
        server.terminate()
        server.wait(timeout=60)
    return run_dir


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compared(row: dict) -> dict:
    return {k: v for k, v in row.items() if not any(part in k for part in NOT_COMPARED)}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def identical(on: Path, off: Path) -> dict:
    """Whether two runs trained the same: metrics (times and ledger aside), groups log, final
    weights and the last checkpoint's buffer (token ids, log-probs) byte for byte."""
    checkpoints = sorted((on / "checkpoints").glob("step-*"))
    last = checkpoints[-1].name if checkpoints else None
    files = ["final/model.safetensors"]
    if last is not None:
        files += [f"checkpoints/{last}/buffer.safetensors", f"checkpoints/{last}/buffer.json"]
    checks = {
        "metrics": [compared(r) for r in jsonl(on / "metrics.jsonl")]
        == [compared(r) for r in jsonl(off / "metrics.jsonl")],
        "groups": jsonl(on / "groups.jsonl") == jsonl(off / "groups.jsonl"),
        **{name: digest(on / name) == digest(off / name) for name in files},
    }
    return {"all": all(checks.values()), **checks}


# --- repeats ---------------------------------------------------------------------------------


def repeat_shares(requests: list[dict], group_size: int, prompts: int, questions: int) -> dict:
    """Each logged search, by the closest scope in which the same key was searched before:
    its group, else its step, else its epoch, else an earlier epoch; or the first of its key.
    Request i is step i + 1, its queries G a group (the scopes nest and come in time order,
    so the key's latest earlier search is the closest)."""
    latest: dict[tuple, tuple[int, int, int]] = {}  # key -> (epoch, step, group) last seen
    counts = dict.fromkeys(KINDS, 0)
    unattributed = 0
    for step, request in enumerate(requests, start=1):
        queries = request["queries"]
        if len(queries) != prompts * group_size:  # some trajectory did not search: groups
            unattributed += len(queries)  # are not G consecutive queries in this request
        epoch = (step - 1) * prompts // questions
        for position, query in enumerate(queries):
            key = (request["retriever"], request["topk"], query)
            where = (epoch, step, position // group_size)
            seen = latest.get(key)
            counts["first" if seen is None else scope(seen, where)] += 1
            latest[key] = where
    total = sum(counts.values())
    return {
        "searches": total,
        "unattributed": unattributed,
        **{kind: counts[kind] for kind in KINDS},
        **{f"{kind}_share": round(counts[kind] / total, 4) for kind in KINDS},
        "repeat_share": round(1 - counts["first"] / total, 4),
    }


def scope(seen: tuple[int, int, int], where: tuple[int, int, int]) -> str:
    """The closest scope two searches share: (epoch, step, group) each."""
    if seen == where:
        return "within_group"
    if seen[1] == where[1]:
        return "within_step"
    if seen[0] == where[0]:
        return "across_steps"
    return "across_epochs"


def ledger(requests: list[dict]) -> dict:
    return {
        "requests": len(requests),
        "queries": sum(len(r["queries"]) for r in requests),
        "billed": sum(r["billed"] for r in requests),
        "cached": sum(r["cached"] for r in requests),
    }


def seed_result(run_on: Path, run_off: Path, group_size: int, prompts: int, questions: int):
    """One seed's repeat shares, ledger with and without the cache, and the identity check."""
    on = jsonl(run_on.parent / f"{run_on.name}.queries.jsonl")
    off = jsonl(run_off.parent / f"{run_off.name}.queries.jsonl")
    metrics = jsonl(run_on / "metrics.jsonl")
    rollouts = sum(r["cost_fresh_groups"] for r in metrics) * group_size
    with_cache, without = ledger(on), ledger(off)
    return {
        "steps": len(metrics),
        "fresh_rollouts": rollouts,
        "repeats": repeat_shares(on, group_size, prompts, questions),
        "with_cache": with_cache,
        "without_cache": without,
        "billed_per_rollout_with_cache": round(with_cache["billed"] / rollouts, 4),
        "billed_per_rollout_without_cache": round(without["billed"] / rollouts, 4),
        "same_queries_in_both_runs": [r["queries"] for r in on] == [r["queries"] for r in off],
        "identical_training": identical(run_on, run_off),
    }


# --- latency, memory, the proxy --------------------------------------------------------------


async def timed_requests(url: str, queries: list[str], retriever: str) -> tuple[list, list]:
    """One client, one query a request, in turn: (client ms, server ms) per request."""
    host, port = url.removeprefix("http://").split(":")
    client = RawClient(host, int(port))
    client_ms, server_ms = [], []
    try:
        for query in queries:
            body = json.dumps(
                {"queries": [query], "topk": 3, "return_scores": True, "retriever": retriever}
            ).encode()
            started = time.perf_counter()
            status, _, took = await client.post("/retrieve", body)
            if status != 200:
                raise SystemExit(f"the latency probe got HTTP {status}")
            client_ms.append(1000 * (time.perf_counter() - started))
            server_ms.append(took)
    finally:
        client.close()
    return client_ms, server_ms


def latency(index: Path, work: Path) -> dict:
    """Misses (queries new to the server), then the same queries again (hits), per retriever."""
    port = free_port()
    server = start_server(index, port, work / "latency.server.log", ["cache.enabled=true"])
    url = f"http://127.0.0.1:{port}"
    queries = list(dict.fromkeys(benchmark_queries()))[:PROBE_QUERIES]  # distinct
    out = {}
    try:
        for retriever in ("bm25", "dense"):
            asyncio.run(timed_requests(url, ["warm-up query"], retriever))
            asked = [f"{query} ({retriever})" for query in queries]
            for outcome in ("miss", "hit"):
                client_ms, server_ms = asyncio.run(timed_requests(url, asked, retriever))
                out[f"{retriever}_{outcome}"] = {
                    "requests": len(asked),
                    "client_p50_ms": round(quantile(client_ms, 0.5), 3),
                    "client_p99_ms": round(quantile(client_ms, 0.99), 3),
                    "server_p50_ms": round(quantile(server_ms, 0.5), 3),
                    "server_p99_ms": round(quantile(server_ms, 0.99), 3),
                }
        cache = httpx.get(f"{url}/health").json()["cache"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    expected = 2 * PROBE_QUERIES  # misses: one per retriever and query; hits: as many
    if cache["hits"] < expected or cache["misses"] < expected:
        raise SystemExit(f"the latency probe's hits and misses are not what it asked: {cache}")
    return out


def cache_memory(index: Path) -> dict:
    """The cache at its default bound, filled with answers of the bed's shape (3 passages of
    the corpus with scores, a question as the query), in this process: entries, its own byte
    count and what tracemalloc saw it allocate."""
    import numpy as np

    from retrieval_server.index.files import DocumentStore, validate_index
    from retrieval_server.serving.answers import render_query
    from retrieval_server.serving.cache import CacheConfig, CacheKey, ResultCache

    store = DocumentStore(validate_index(index).corpus, np.load(index / "offsets.npy"))
    rng = np.random.default_rng(0)
    questions = benchmark_queries()
    passages = [store.get_json(row) for row in range(len(store))]
    bound = CacheConfig().max_bytes
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache = ResultCache(bound, fingerprint="bench")
    answer_bytes = query_chars = 0
    while not cache.stats.evictions:
        rows = rng.integers(0, len(passages), 3)
        answer = render_query([(passages[r], float(rng.random())) for r in rows], True)
        query = f"{questions[len(cache) % len(questions)]} {len(cache)}"
        cache.put(CacheKey("", "bm25", 3, True, query), answer)
        answer_bytes += len(answer)
        query_chars += len(query)
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    store.close()
    entries = len(cache)
    return {
        "max_bytes": bound,
        "entries": entries,
        "accounted_bytes": cache.bytes,
        "traced_bytes": traced,
        "traced_over_accounted": round(traced / cache.bytes, 3),
        "mean_answer_bytes": round(answer_bytes / (entries + 1)),
        "mean_query_chars": round(query_chars / (entries + 1)),
    }


def proxy_run(index: Path, requests: list[dict], work: Path) -> dict:
    """The logged requests, in order, through a proxy (`hdr serve --upstream`) in front of a
    second `hdr serve` that charges EMULATED_MS a call and has no cache: its own counters."""
    upstream_port, proxy_port = free_port(), free_port()
    upstream_settings = ["cache.enabled=false", f"emulated_cost.request_latency_ms={EMULATED_MS}"]
    upstream = start_server(index, upstream_port, work / "upstream.log", upstream_settings)
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    proxy = start_server(
        None, proxy_port, work / "proxy.log", ["cache.enabled=true"], upstream=upstream_url
    )
    try:
        forwarded = 0
        started = time.perf_counter()
        with httpx.Client(base_url=f"http://127.0.0.1:{proxy_port}", timeout=120) as client:
            for request in requests:
                body = {key: request[key] for key in ("queries", "topk", "retriever")}
                response = client.post("/retrieve", json={**body, "return_scores": True})
                response.raise_for_status()
                forwarded += int(response.headers["x-hdr-billed-queries"])
        wall = time.perf_counter() - started
        charged = httpx.get(f"{upstream_url}/health").json()["emulated_cost"]
        searched = sum(
            float(line.split()[-1])
            for line in httpx.get(f"{upstream_url}/metrics").text.splitlines()
            if line.startswith("hdr_retrieval_queries_total")
        )
        report = httpx.get(f"http://127.0.0.1:{proxy_port}/health").json()["upstream"]
    finally:
        for process in (proxy, upstream):
            process.terminate()
            process.wait(timeout=60)
    sent = ledger([{**r, "billed": 0, "cached": 0} for r in requests])
    return {
        "upstream_emulated_ms_per_call": EMULATED_MS,
        "requests_to_proxy": sent["requests"],
        "queries_to_proxy": sent["queries"],
        "proxy_billed_queries": forwarded,
        "proxy_upstream_calls": report["calls"],
        "upstream_requests_charged": charged["requests_charged"],
        "upstream_queries_searched": int(searched),
        "upstream_seconds_waited": charged["seconds_waited"],
        "wall_s": round(wall, 2),
        "without_proxy": {
            "upstream_requests": sent["requests"],
            "upstream_queries": sent["queries"],
        },
    }


# --- the report ------------------------------------------------------------------------------


def print_report(report: dict, console: Console) -> None:
    table = Table(title="search calls on the CPU bed's training run (tiny-cpu.yaml, bm25)")
    columns = ("seed", "searches", "first", "in group", "in step", "across steps",
               "across epochs", "billed/rollout no cache", "with cache", "identical")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for seed, row in report["seeds"].items():
        r = row["repeats"]
        table.add_row(
            seed, str(r["searches"]), f"{r['first_share']:.1%}",
            f"{r['within_group_share']:.1%}", f"{r['within_step_share']:.1%}",
            f"{r['across_steps_share']:.1%}", f"{r['across_epochs_share']:.1%}",
            f"{row['billed_per_rollout_without_cache']:.3f}",
            f"{row['billed_per_rollout_with_cache']:.3f}", str(row["identical_training"]["all"]),
        )  # fmt: skip
    console.print(table)
    probe = Table(title=f"latency, one client, {PROBE_QUERIES} requests of one query (ms)")
    for column in ("case", "client p50", "client p99", "server p50", "server p99"):
        probe.add_column(column, justify="right")
    quantiles = ("client_p50_ms", "client_p99_ms", "server_p50_ms", "server_p99_ms")
    for case, row in report["latency"].items():
        probe.add_row(case, *(f"{row[k]:.2f}" for k in quantiles))
    console.print(probe)
    m, p = report["memory"], report["proxy"]
    console.print(
        f"cache at its default bound ({m['max_bytes'] / 2**20:.0f} MiB): {m['entries']:,} answers"
        f" of {m['mean_answer_bytes']:,} bytes; tracemalloc {m['traced_bytes'] / 2**20:.0f} MiB"
        f" ({m['traced_over_accounted']:.2f}x its count)"
    )
    console.print(
        f"proxy: {p['queries_to_proxy']:,} queries in {p['requests_to_proxy']} requests reached"
        f" the upstream as {p['upstream_queries_searched']:,} queries in"
        f" {p['upstream_requests_charged']} charged calls ({p['upstream_seconds_waited']:.1f} s"
        f" of emulated cost at {p['upstream_emulated_ms_per_call']:g} ms a call)"
    )


def main(
    index: Path = typer.Option(Path("data/index"), help="Index of the embedded corpus."),
    model: Path = typer.Option(Path("data/tiny-sft"), help="The bed's SFT start (hdr sft)."),
    seeds: str = typer.Option("0,1", help="Training seeds, comma-separated (2 or more)."),
    work: Path = typer.Option(
        Path("runs/bench-search-cache"), help="Runs and logs (a rerun reuses finished runs)."
    ),
    out: Path = typer.Option(Path("bench/results/search_cache.json"), help="JSON results."),
    settings: list[str] = typer.Option(
        [], "--set", help="Extra `hdr train` settings for every run, e.g. --set steps=20."
    ),
) -> None:
    from agent_env.data import load_questions
    from core.config import load_config
    from trainer.config import TrainConfig

    console = Console(width=max(Console().width, 140))
    load_before = list(os.getloadavg())
    config = load_config(TrainConfig, CONFIG, [f"model.path={model}", *settings])
    group_size, prompts = config.grpo.group_size, config.grpo.batch_prompts
    questions = len(load_questions(config.data, config.seed, 0)[0])  # the run's pool
    work.mkdir(parents=True, exist_ok=True)
    seed_list = [int(s) for s in seeds.split(",")]
    results, logs = {}, []
    for seed in seed_list:
        for cache in (True, False):
            console.print(f"seed {seed}: training with the cache {'on' if cache else 'off'}")
            train_run(index, model, seed, cache, work, settings)
        run_on, run_off = work / f"seed{seed}-cache-on", work / f"seed{seed}-cache-off"
        results[str(seed)] = seed_result(run_on, run_off, group_size, prompts, questions)
        logs.append(jsonl(work / f"seed{seed}-cache-on.queries.jsonl"))
    console.print("latency probe, cache memory, proxy run")
    report = {
        "command": "bench/search_cache.py " + " ".join(sys.argv[1:]),
        "machine": machine_facts(load_before, note="server, trainer and probes share the cores"),
        "config": str(CONFIG),
        "train_settings": ["eval.every=0", "eval.at_start=false", *settings],
        "group_size": group_size,
        "prompts_per_step": prompts,
        "training_questions": questions,
        "seeds": results,
        "latency": latency(index, work),
        "memory": cache_memory(index),
        "proxy": proxy_run(index, logs[0], work),
        "note": "the tiny policy's repeats; a real model's share is not measured here",
    }
    report["machine"]["load_average_after"] = list(os.getloadavg())
    write_report(out, report)
    print_report(report, console)
    console.print(f"written to {out}")


if __name__ == "__main__":
    typer.run(main)
