"""Re-scoring cost: re-scoring one stored group teacher-forced, relative to producing it fresh.

    .venv/bin/hdr serve --index data/index --port 8000 &
    .venv/bin/python bench/rescoring.py --config configs/tiny-cpu.yaml --model data/tiny-sft

Each round rolls out b prompts x G responses from the wiki-vital train split with the
config's rollout settings (hf backend, the tiny policy, the server's BM25), which is what a
fresh group costs: generation plus retrieval, `rollout.wall_time / b` per group. The groups
are then re-scored under the same weights, no grad, exactly as the replay selector does
(`trainer.scoring.score_groups`): each group alone (the conservative figure, used for the
target), and in chunks of `replay.scan_chunk` groups (what a scan does). Exact duplicate
responses in a group are scored once (trainer.scoring), so the table also gives the mean
number of distinct responses per group. Target: re-scoring
one group costs at most 0.2 x producing it fresh. Writes bench/results/rescoring.json and
prints a table.
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

import torch
from rich.console import Console
from rich.table import Table

from agent_env.data import load_task
from agent_env.generation import build_generator
from agent_env.retrieval_client import RetrievalClient
from agent_env.rollout import rollout_groups
from core.config import load_config
from trainer.config import TrainConfig
from trainer.fresh import sample_prompts
from trainer.run import load_policy
from trainer.scoring import behaviour_groups, score_groups, unique_rows

TARGET = 0.2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--model", default=None, help="Model dir (default: the config's model.path)")
    ap.add_argument("--server", default=None, help="Retrieval URL (default: the config's)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="bench/results/rescoring.json")
    args = ap.parse_args()
    overrides = [f"model.path={args.model}"] if args.model else []
    overrides += [f"retrieval.urls=[{args.server}]"] if args.server else []
    cfg = load_config(TrainConfig, args.config, overrides)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_policy(cfg.model.path, cfg)
    generator = build_generator(
        cfg.generation, model_dir=cfg.model.path, tokenizer=tokenizer,
        prompt=cfg.rollout.prompt, model=model,
    )  # fmt: skip
    examples = load_task(cfg.data.train, cfg.data.train_split)
    b, G, chunk = cfg.grpo.batch_prompts, cfg.grpo.group_size, cfg.replay.scan_chunk
    rows = []
    with RetrievalClient(cfg.retrieval, seed=cfg.seed) as client:
        for r in range(args.rounds + 1):  # round 0 warms up
            batch = sample_prompts(examples, cfg.seed, r + 1, b)
            result = rollout_groups(generator, client, tokenizer, batch, G, cfg.rollout)
            groups, _, _ = behaviour_groups(
                model, result.groups, r + 1, range(len(result.groups)), cfg.grpo.score_chunk,
                cfg.rollout.temperature,
            )  # fmt: skip
            alone = []
            for g in groups:
                start = time.perf_counter()
                score_groups(model, [g], cfg.grpo.score_chunk, cfg.rollout.temperature)
                alone.append(time.perf_counter() - start)
            start = time.perf_counter()
            for lo in range(0, len(groups), chunk):
                score_groups(model, groups[lo : lo + chunk], cfg.grpo.score_chunk)
            chunked = (time.perf_counter() - start) / len(groups)
            if r == 0:
                continue
            fresh = result.wall_time / len(result.groups)
            rows.append(
                dict(
                    fresh_per_group=fresh,
                    generation_per_group=result.gen_time / len(result.groups),
                    retrieval_per_group=result.retrieval_time / len(result.groups),
                    rescore_alone=statistics.median(alone),
                    rescore_chunked=chunked,
                    ratio_alone=statistics.median(alone) / fresh,
                    ratio_chunked=chunked / fresh,
                    tokens_per_group=statistics.mean(int(g.attention_mask.sum()) for g in groups),
                    distinct_rows_per_group=statistics.mean(
                        len(unique_rows(g.input_ids, g.attention_mask, g.loss_mask)[0])
                        for g in groups
                    ),
                )
            )
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    report = dict(
        config=args.config, model=cfg.model.path, b=b, G=G, scan_chunk=chunk,
        rounds=rows, median=summary, target=TARGET, meets_target=summary["ratio_alone"] <= TARGET,
        load_average=os.getloadavg(), torch_threads=torch.get_num_threads(),
    )  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    table = Table(title=f"re-scoring vs fresh, per group (b={b}, G={G}, median of {len(rows)})")
    for col in ("fresh (gen+ret)", "gen", "ret", "rescore alone", "rescore chunked",
                "ratio alone", "ratio chunked", "distinct/G", f"target <= {TARGET}"):  # fmt: skip
        table.add_column(col)
    s = summary
    table.add_row(
        f"{s['fresh_per_group'] * 1e3:.0f} ms", f"{s['generation_per_group'] * 1e3:.0f} ms",
        f"{s['retrieval_per_group'] * 1e3:.1f} ms", f"{s['rescore_alone'] * 1e3:.1f} ms",
        f"{s['rescore_chunked'] * 1e3:.1f} ms", f"{s['ratio_alone']:.3f}",
        f"{s['ratio_chunked']:.3f}", f"{s['distinct_rows_per_group']:.1f}/{G}",
        "yes" if report["meets_target"] else "NO",
    )  # fmt: skip
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
