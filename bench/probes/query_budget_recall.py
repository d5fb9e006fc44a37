"""BM25 rank-1 recall of wiki-vital under a query budget: which words of the description to
search when only the first N reach the retriever (`rollout.max_query_words`).

    .venv/bin/hdr serve --index data/index --retriever bm25 --port 8000 &
    .venv/bin/python bench/probes/query_budget_recall.py --url http://127.0.0.1:8000 \
        --corpus data/wiki-vital.jsonl

For every question of the split (a vital article's description; answer: its title) and each
budget N it searches, through the real server, the whole description and N of its words
chosen by a rule, and counts how often Doc 1 is the article (rank 1, what a policy that
answers Doc 1's title scores) and how often the article is in the top 3:

- `first`: the description's first N words (what a start that copies the question sends);
- `first_non_stop`: its first N words that are not stopwords (BM25's own English list, the
  words the server drops anyway): a general skill;
- `rarest`: its N words of lowest document frequency in the corpus (a word's rarest BM25
  token; words BM25 ignores come last; ties keep the description's order);
- `random_subset`: the mean over every N-word subset (BM25 ignores order): what a policy that
  puts N random words of the description first scores on average;
- `best_subset`: whether some N-word subset finds the article at rank 1: the ceiling of any
  choice of words, question by question.

Words are whitespace-separated, as the budget counts them. Counts, not times: the figures do
not depend on the machine. Writes bench/results/query_budget_recall.json and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
from rich.console import Console
from rich.table import Table

from agent_env.data import load_task
from agent_env.retrieval_client import RetrievalClient, RetrievalConfig
from retrieval_server.index.corpus import split_contents

TOKEN = re.compile(r"(?u)\b\w\w+\b")  # bm25s's default splitter: the server's BM25 tokens
RULES = ("first", "first_non_stop", "rarest", "random_subset", "best_subset")


def stopwords() -> frozenset[str]:
    """The English stopwords the server's BM25 tokenizer drops (retrieval_server.index.files)."""
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


def document_frequency(corpus: Path) -> Counter:
    """How many passages of the corpus hold each lower-cased BM25 token."""
    df: Counter = Counter()
    with corpus.open() as lines:
        for line in lines:
            df.update({t.lower() for t in TOKEN.findall(json.loads(line)["contents"])})
    return df


def rarity(word: str, df: Counter, stop: frozenset[str]) -> float:
    """A word's rarest BM25 token's document frequency; inf when BM25 ignores the word."""
    counts = [df[t.lower()] for t in TOKEN.findall(word) if t.lower() not in stop]
    counts = [c for c in counts if c > 0]
    return min(counts) if counts else float("inf")


def chosen_words(words: list[str], rule: str, n: int, df: Counter, stop: frozenset[str]):
    """The N words `rule` searches (`first`, `first_non_stop`, `rarest`)."""
    if rule == "first":
        return words[:n]
    if rule == "first_non_stop":
        return [w for w in words if rarity(w, df, stop) < float("inf")][:n]
    return sorted(words, key=lambda w: rarity(w, df, stop))[:n]  # stable: description order


def ranks(client: RetrievalClient, queries: list[str], titles: list[str]) -> np.ndarray:
    """Per query: 1, 2 or 3 where the title's article ranks in the top 3, else 0."""
    out = []
    for docs, title in zip(client.search(queries), titles, strict=True):
        found = [split_contents(d.contents)[0] for d in docs]
        out.append(found.index(title) + 1 if title in found else 0)
    return np.asarray(out)


def budget_figures(client, examples, n: int, df: Counter, stop: frozenset[str]) -> dict:
    """Rank-1 and top-3 recall of each rule under an N-word budget."""
    titles = [ex.golden_answers[0] for ex in examples]
    figures = {}
    for rule in ("first", "first_non_stop", "rarest"):
        queries = [
            " ".join(chosen_words(ex.question.split(), rule, n, df, stop)) for ex in examples
        ]
        r = ranks(client, queries, titles)
        figures[rule] = {"rank1": float(np.mean(r == 1)), "top3": float(np.mean(r > 0))}
    words = [ex.question.split() for ex in examples]
    subsets = [list(itertools.combinations(w, min(n, len(w)))) for w in words]
    flat = [" ".join(s) for subset in subsets for s in subset]
    owners = [i for i, subset in enumerate(subsets) for _ in subset]
    r = ranks(client, flat, [titles[i] for i in owners])
    per_question = [r[np.asarray(owners) == i] for i in range(len(examples))]
    figures["random_subset"] = {
        "rank1": float(np.mean([np.mean(x == 1) for x in per_question])),
        "top3": float(np.mean([np.mean(x > 0) for x in per_question])),
    }
    figures["best_subset"] = {
        "rank1": float(np.mean([np.any(x == 1) for x in per_question])),
        "top3": float(np.mean([np.any(x > 0) for x in per_question])),
    }
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--corpus", default="data/wiki-vital.jsonl", help="The indexed corpus.")
    ap.add_argument("--split", default="test")
    ap.add_argument("--budgets", default="3,2", help="Comma-separated N.")
    ap.add_argument("--out", default="bench/results/query_budget_recall.json")
    args = ap.parse_args()
    examples = load_task("wiki-vital", args.split)
    df, stop = document_frequency(Path(args.corpus)), stopwords()
    config = RetrievalConfig(urls=[args.url], topk=3, retriever="bm25", max_batch_queries=256)
    with RetrievalClient(config) as client:
        titles = [ex.golden_answers[0] for ex in examples]
        whole = ranks(client, [ex.question for ex in examples], titles)
        budgets = {
            n: budget_figures(client, examples, n, df, stop)
            for n in (int(x) for x in args.budgets.split(","))
        }
    result = {
        "split": args.split,
        "questions": len(examples),
        "whole_description": {
            "rank1": float(np.mean(whole == 1)),
            "top3": float(np.mean(whole > 0)),
        },
        "budgets": {str(n): figures for n, figures in budgets.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title=f"BM25 recall on wiki-vital {args.split} ({len(examples)} questions)")
    table.add_column("query")
    for n in budgets:
        table.add_column(f"N = {n}: rank 1", justify="right")
        table.add_column(f"N = {n}: top 3", justify="right")
    for rule in RULES:
        cells = [f"{budgets[n][rule][m]:.3f}" for n in budgets for m in ("rank1", "top3")]
        table.add_row(rule, *cells)
    w = result["whole_description"]
    table.add_row("whole description", *[f"{w[m]:.3f}" for _ in budgets for m in ("rank1", "top3")])
    Console().print(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
