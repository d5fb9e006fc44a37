"""Rollout benchmark: trajectories/s, share of time waiting on retrieval, env-call concurrency.

    .venv/bin/hdr serve --index data/index --port 8000 &
    .venv/bin/python bench/rollout.py --model data/tiny-policy --server http://127.0.0.1:8000

Each run rolls out `--rounds` batches of b prompts x G responses from the wiki-vital test split
with the tiny policy (hf backend, compact prompt, T=1) and records, per batch, the rollout's
wall time, its generation time and its retrieval time. The target: wall time at most 1.1 x
(generation time + one batched retrieval call per turn), i.e. the loop's own bookkeeping
(tokenizing observations, parsing actions) costs under 10%. As a reference the same queries
are also sent as one raw httpx POST, to show what the client adds over the wire cost.
Runs: `hf` with one URL, `hf` with the server listed twice (requests split and sent
concurrently), and `scripted` (no model: the retrieval-bound extreme). Writes
bench/results/rollout.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx
import torch
from rich.console import Console
from rich.table import Table

from agent_env.data import wiki_vital_examples
from agent_env.generation import GenerationConfig, build_generator
from agent_env.prompts import PromptConfig
from agent_env.retrieval_client import RetrievalClient, RetrievalConfig
from agent_env.rollout import RolloutConfig, parse_action, rollout_groups


def raw_call_time(url: str, queries: list[str], topk: int, retriever: str | None) -> float:
    """One batched POST with plain httpx: the wire+server cost of a turn's searches."""
    body = {"queries": queries or ["?"], "topk": topk}
    if retriever:
        body["retriever"] = retriever
    start = time.perf_counter()
    httpx.post(f"{url}/retrieve", json=body, timeout=60).raise_for_status()
    return time.perf_counter() - start


def first_queries(trajectories, tokenizer, prefix: str) -> list[str]:
    """The first-turn search query of each trajectory that searched (the same parse)."""
    queries = []
    for traj in trajectories:
        if not traj.searches:
            continue
        first_run = traj.loss_mask.index(0) if 0 in traj.loss_mask else len(traj.loss_mask)
        text = tokenizer.decode(traj.response_ids[:first_run], skip_special_tokens=False)
        action = parse_action(prefix + text, finished=False)
        queries.append(action.content or "?")
    return queries


def run(name, backend, urls, args, tokenizer, examples, config) -> dict:
    prompt = config.prompt
    generator = build_generator(
        GenerationConfig(backend=backend), model_dir=args.model, tokenizer=tokenizer, prompt=prompt
    )
    client_config = RetrievalConfig(urls=urls, topk=args.topk, retriever=args.retriever)
    rows = []
    with RetrievalClient(client_config, seed=0) as client:
        torch.manual_seed(0)
        rollout_groups(generator, client, tokenizer, examples[:2], 2, config)  # warm-up
        for r in range(args.rounds):
            batch = examples[r * args.b : (r + 1) * args.b]
            result = rollout_groups(generator, client, tokenizer, batch, args.G, config)
            trajs = [t for g in result.groups + result.dropped for t in g]
            queries = first_queries(trajs, tokenizer, config.prompt.response_prefix)
            rows.append(
                dict(
                    wall=result.wall_time,
                    gen=result.gen_time,
                    ret=result.retrieval_time,
                    turns_with_search=result.retrieval_calls,
                    env_calls=result.env_calls,
                    trajectories=len(trajs),
                    failed=sum(t.failed for t in trajs),
                    raw_call=raw_call_time(urls[0], queries, args.topk, args.retriever),
                )
            )
        in_flight = client.stats.max_in_flight
    wall = sum(r["wall"] for r in rows)
    gen = sum(r["gen"] for r in rows)
    ret = sum(r["ret"] for r in rows)
    n = sum(r["trajectories"] for r in rows)
    return {
        "run": name,
        "backend": backend,
        "urls": len(urls),
        "batches": len(rows),
        "trajectories": n,
        "trajectories_per_s": n / wall,
        "wall_s": wall,
        "generation_s": gen,
        "retrieval_s": ret,
        "retrieval_share": ret / wall,
        "overhead_ratio": wall / (gen + ret),
        "target_met": wall <= 1.1 * (gen + ret),
        "batched_calls_per_turn": statistics.mean(
            r["env_calls"] / max(r["turns_with_search"], 1) for r in rows
        ),
        "max_concurrent_requests": in_flight,
        "mean_retrieval_call_s": ret / max(sum(r["turns_with_search"] for r in rows), 1),
        "mean_raw_http_call_s": statistics.mean(r["raw_call"] for r in rows),
        "failed": sum(r["failed"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("data/tiny-policy"))
    parser.add_argument("--server", default="http://127.0.0.1:8000")
    parser.add_argument("--retriever", default=None, help="dense or bm25 (server default)")
    parser.add_argument("--b", type=int, default=16, help="prompts per batch")
    parser.add_argument("--G", type=int, default=8, help="responses per prompt")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--max-tokens-per-turn", type=int, default=24)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: see docs/agent_env.md)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/rollout.json"))
    args = parser.parse_args()

    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    examples = wiki_vital_examples("test")
    config = RolloutConfig(
        prompt=PromptConfig.preset("compact"),
        max_turns=1,
        max_tokens_per_turn=args.max_tokens_per_turn,
        doc_words=8,
        on_failure="keep",
    )
    load_before = os.getloadavg()[0]
    runs = [
        run("hf, 1 URL", "hf", [args.server], args, tokenizer, examples, config),
        run(
            "hf, 2 URLs", "hf", [args.server, args.server + "/"], args, tokenizer, examples, config
        ),
        run("scripted, 1 URL", "scripted", [args.server], args, tokenizer, examples, config),
    ]
    setup = {
        "b": args.b,
        "G": args.G,
        "rounds": args.rounds,
        "topk": args.topk,
        "retriever": args.retriever or "server default",
        "max_tokens_per_turn": args.max_tokens_per_turn,
        "max_turns": config.max_turns,
        "doc_words": config.doc_words,
        "cpu_threads": torch.get_num_threads(),
        "model": str(args.model),
        "load_average_1min": [load_before, os.getloadavg()[0]],  # other work on the machine
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"setup": setup, "runs": runs}, indent=2) + "\n")

    table = Table(title=f"rollout benchmark: b={args.b} x G={args.G}, {args.rounds} batches")
    for col in (
        "run",
        "traj/s",
        "wall s",
        "gen s",
        "retr s",
        "retr share",
        "wall/(gen+retr)",
        "calls/turn",
        "max in flight",
        "retr call s",
        "raw POST s",
    ):
        table.add_column(col, justify="right")
    for r in runs:
        table.add_row(
            r["run"], f"{r['trajectories_per_s']:.1f}", f"{r['wall_s']:.2f}",
            f"{r['generation_s']:.2f}", f"{r['retrieval_s']:.2f}", f"{r['retrieval_share']:.1%}",
            f"{r['overhead_ratio']:.3f}", f"{r['batched_calls_per_turn']:.1f}",
            f"{r['max_concurrent_requests']}", f"{r['mean_retrieval_call_s']:.3f}",
            f"{r['mean_raw_http_call_s']:.3f}",
        )  # fmt: skip
    Console().print(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
