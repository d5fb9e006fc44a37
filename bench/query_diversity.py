"""Do a start's sampled searches vary the words that reach the retriever, and do some groups'
rewards differ because of the query? The check before a query-budget pilot (issue 49).

    .venv/bin/hdr rollout --model data/tiny-sft-q2 --data wiki-vital --split rl \
        --max-questions 300 --group-size 5 --server http://127.0.0.1:8000 \
        --out runs/q2-start.jsonl
    .venv/bin/python bench/query_diversity.py --trajectories runs/q2-start.jsonl --budget 2 \
        --out bench/results/query_diversity_q2.json

It reads the trajectories `hdr rollout` wrote (the model's own prompt and rollout settings,
its query budget included) and, for each, the search the policy wrote and the first
`--budget` words of it, what reached the retriever (`agent_env.rollout.budget_query`). Per
trajectory: whether those words are the description's first ones (what a start that copies
sends), whether every one of them is a word of the description (not a corrupted copy). Per
group of G samples of one question: how many distinct word sets reached the retriever (BM25
ignores order), whether the rewards are mixed (a group GRPO learns from) and, if so, whether
the query explains it: no word set that reached the retriever was rewarded in one sample and
not in another (then the answers did not differ for the same retrieval: the query did). Writes
the JSON and prints a table; counts, not times.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from agent_env.rollout import budget_query, parse_action


def sent_words(record: dict, budget: int) -> list[str] | None:
    """The words of the trajectory's first search that reached the retriever (None: it made
    none). A response may start inside the prompt's open `<search>` (the compact prompt)."""
    text = record["response_text"]
    if "<search>" not in text.split("</search>")[0]:
        text = "<search>" + text
    action = parse_action(text, finished=True)
    if action.kind != "search":
        return None
    return budget_query(action.content, budget).split()


def group_figures(records: list[dict], budget: int) -> dict:
    """The per-trajectory and per-group figures of one group of samples."""
    words = [sent_words(r, budget) for r in records]
    question = records[0]["question"].split()
    vocabulary = {w.lower() for w in question}
    rewards = [r["reward"] for r in records]
    keys = [frozenset(w.lower() for w in ws) if ws is not None else None for ws in words]
    by_query: dict = defaultdict(set)
    for key, reward in zip(keys, rewards, strict=True):
        by_query[key].add(reward)
    mixed = len(set(rewards)) > 1
    return {
        "copies_first_words": [ws == question[:budget] for ws in words],
        "in_description": [
            ws is not None and all(w.lower() in vocabulary for w in ws) for ws in words
        ],
        "searched": [ws is not None for ws in words],
        "distinct_sent": len({k for k in keys if k is not None}),
        "mixed": mixed,
        "query_explains": mixed
        and len(by_query) > 1
        and all(len(v) == 1 for v in by_query.values()),
        "rewards": rewards,
    }


def figures(records: list[dict], budget: int) -> dict:
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        groups[record["group_id"]].append(record)
    per = [group_figures(g, budget) for g in groups.values()]
    flat = lambda key: [x for g in per for x in g[key]]  # noqa: E731
    copies = np.asarray(flat("copies_first_words"))
    rewards = np.asarray(flat("rewards"))
    mixed = [g for g in per if g["mixed"]]
    return {
        "budget": budget,
        "groups": len(per),
        "trajectories": len(records),
        "group_size": round(len(records) / max(len(per), 1), 3),
        "searched": float(np.mean(flat("searched"))),
        "sent_first_words": float(copies.mean()),
        "sent_other_words": float(1 - copies.mean()),
        "sent_only_description_words": float(np.mean(flat("in_description"))),
        "distinct_sent_per_group": float(np.mean([g["distinct_sent"] for g in per])),
        "groups_all_same_sent": float(np.mean([g["distinct_sent"] <= 1 for g in per])),
        "reward": float(rewards.mean()),
        "reward_when_first_words": float(rewards[copies].mean()) if copies.any() else None,
        "reward_when_other_words": float(rewards[~copies].mean()) if (~copies).any() else None,
        "mixed_groups": len(mixed) / max(len(per), 1),
        "mixed_groups_explained_by_query": (
            sum(g["query_explains"] for g in mixed) / len(mixed) if mixed else None
        ),
        "groups_mixed_by_query": sum(g["query_explains"] for g in per) / max(len(per), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajectories", required=True, help="`hdr rollout --out` JSONL.")
    ap.add_argument("--budget", type=int, required=True, help="rollout.max_query_words.")
    ap.add_argument("--label", default="", help="A name for the table and the JSON.")
    ap.add_argument("--out", default="bench/results/query_diversity.json")
    args = ap.parse_args()
    lines = Path(args.trajectories).read_text().splitlines()
    result = {"label": args.label, **figures([json.loads(x) for x in lines if x], args.budget)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title=f"what reaches the retriever: {args.label or args.trajectories}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    Console().print(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
