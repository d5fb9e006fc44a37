"""The small held-out evaluation run during training (eval.jsonl).

A fixed subset of the held-out task, through the same rollout loop as training: `k` samples
per question at the rollout temperature (Mean@k, Best@k) and one greedy decode (greedy EM).
The sampling seeds are fixed for the whole run, not drawn anew at each step, so frozen
weights score exactly the same at every step and a change between two evaluations is the
weights' (with seeds varying by step, the 200 x 4 evaluation moved by 0.01 with frozen
weights). A backend that seeds each request (`Generator.per_request_seeds`, vLLM) gets one
seed per question and sample, a hash of (run seed, question id, sample index), so a
question's draws do not depend on the other questions either; the HF backend samples the
whole batch from torch's RNG, seeded with the run's seed alone, so there a question's draws
are fixed for given weights but move with the other questions' lengths once the weights
move. Either way it runs under a forked torch RNG, so evaluating never changes what training
samples next, and a resumed run evaluates exactly as the original.
Across processes every rank evaluates its round-robin share of the questions and the
correctness of every question is gathered (no rank waits on another's whole evaluation
inside a collective); the questions are the same, the samples differ from a one-process run.
The full evaluation over every test set is `hdr eval` (evaluation.evaluate).
"""

from __future__ import annotations

from typing import Any

import torch

from agent_env.rewards import best_at_k, mean_at_k
from core.errors import UserError, warn


def heldout_samples(run, examples, k: int):
    """The `k` sampled groups and the greedy groups (None when greedy is off or a sampled
    question was dropped) of `examples`, under the run's fixed held-out seeds."""
    from agent_env.rollout import question_seeds, rollout_groups

    cfg = run.config
    seeds = question_seeds(cfg.seed, examples, k) if run.generator.per_request_seeds else None
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):
        torch.manual_seed(cfg.seed * 1_000_003)  # the same at every step
        sampled = rollout_groups(
            run.generator, run.client, run.tokenizer, examples, k, cfg.rollout, seeds=seeds
        )
        greedy = None
        if cfg.eval.greedy and not sampled.dropped:
            greedy_cfg = cfg.rollout.model_copy(update={"temperature": 0.0})
            greedy = rollout_groups(
                run.generator, run.client, run.tokenizer, examples, 1, greedy_cfg
            )
    return sampled, greedy


def heldout_eval(run, step: int) -> dict[str, Any] | None:
    """The step's record for eval.jsonl; None (with a warning) when some questions could not
    reach the retrieval server, a UserError when none could."""
    from agent_env.rewards import exact_match

    def em(t) -> bool:
        return exact_match(t.answer, t.example.golden_answers) >= 1.0

    cfg, dist = run.config, run.dist
    examples, k = run.eval_examples[dist.rank :: dist.world], cfg.eval.k
    sampled, greedy = heldout_samples(run, examples, k)
    greedy_hits = None if greedy is None else [em(g[0]) for g in greedy.groups]
    shares = dist.all_gather(
        ([[em(t) for t in group] for group in sampled.groups], greedy_hits, len(sampled.dropped))
    )
    correct = [row for part, _, _ in shares for row in part]
    dropped = sum(n for _, _, n in shares)
    if dropped:
        where = f"the retrieval server ({', '.join(cfg.retrieval.urls)})"
        if not correct:
            raise UserError(
                f"held-out evaluation at step {step}: no question could reach {where};"
                " is it running? (hdr serve --index DIR)"
            )
        # scores over fewer questions would not compare with the other steps'
        warn(
            f"held-out evaluation at step {step} skipped: {dropped} of"
            f" {len(run.eval_examples)} questions could not reach {where}"
        )
        return None
    greedy_em = None
    if cfg.eval.greedy:
        hits = [hit for _, part, _ in shares for hit in part]
        greedy_em = float(sum(hits) / max(len(hits), 1))
    return {
        "step": step,
        "env_calls_total": run.counters.env_calls_total,
        "wall_time_total": run.counters.wall_time_total,
        "mean_at_k": mean_at_k(correct),
        "best_at_k": best_at_k(correct),
        "greedy_em": greedy_em,
        "k": k,
        "num_questions": len(correct),
    }
