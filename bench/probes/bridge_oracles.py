"""Scripted oracles on the multi-turn `wiki-bridge` task: two searches against one.

    .venv/bin/hdr serve --index data/index --retriever bm25 --port 8000 &
    .venv/bin/python bench/probes/bridge_oracles.py --url http://127.0.0.1:8000 \
        --model data/tiny-policy

The one-search oracle searches the question and answers the gold title when it was
retrieved (else Doc 1's); the two-search oracle then searches Doc 1's title (the bridge hop)
and answers the gold title when either search retrieved it (else the first title of the
second block it has not searched). Both run through the real rollout loop (max_turns 2, top 3
BM25 passages of 8 words) on every question of the split. The task is meant to need two
searches: target, two-search EM at least twice one-search EM. Counts, not times: the figures
do not depend on the machine. Writes bench/results/bridge_oracles.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from agent_env.data import wiki_bridge_examples
from agent_env.generation.scripted import ScriptedGenerator
from agent_env.prompts import PromptConfig
from agent_env.retrieval_client import RetrievalClient, RetrievalConfig
from agent_env.rollout import RolloutConfig, rollout_groups

TARGET = 2.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="data/tiny-policy", help="Tokenizer directory.")
    ap.add_argument("--split", default="test")
    ap.add_argument("--out", default="bench/results/bridge_oracles.json")
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt = PromptConfig.preset("compact").model_copy(update={"observation_suffix": ""})
    config = RolloutConfig(prompt=prompt, max_turns=2, doc_words=8, max_obs_tokens=128)
    examples = wiki_bridge_examples(args.split)
    oracle = {ex.question: ex.golden_answers for ex in examples}
    figures = {}
    with RetrievalClient(RetrievalConfig(urls=[args.url], topk=3, retriever="bm25")) as client:
        for searches in (1, 2):
            policy = ScriptedGenerator(tokenizer, prompt, oracle=oracle, searches=searches)
            result = rollout_groups(policy, client, tokenizer, examples, 1, config)
            trajs = [t for g in result.groups for t in g]
            figures[searches] = {
                "questions": len(trajs),
                "exact_match": sum(t.reward for t in trajs) / len(trajs),
                "searches_per_question": sum(t.searches for t in trajs) / len(trajs),
            }
    ratio = figures[2]["exact_match"] / max(figures[1]["exact_match"], 1e-9)
    report = {"split": args.split, "oracles": figures, "ratio": ratio, "target": TARGET,
              "meets_target": ratio >= TARGET}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    table = Table(title=f"wiki-bridge {args.split}: scripted oracles (BM25 top 3)")
    for col in ("oracle", "questions", "EM", "searches"):
        table.add_column(col)
    for searches, f in figures.items():
        table.add_row(f"{searches} search{'es' if searches > 1 else ''}", str(f["questions"]),
                      f"{f['exact_match']:.3f}", f"{f['searches_per_question']:.2f}")  # fmt: skip
    Console().print(table)
    verdict = "meets" if ratio >= TARGET else "MISSES"
    Console().print(f"two / one search: {ratio:.2f} ({verdict} >= {TARGET})")


if __name__ == "__main__":
    main()
