"""One GRPO step with Headroom-Drift Replay: `train_step(run, step) -> StepRecord`.

The method is the paper's ("Headroom-Drift Replay: A Primitive for Principled Replay Control
in GRPO", arXiv 2609.03941). One step, top to bottom (`train_step`; docs/design.md):
1. rollout: `b` prompts, `G` responses each, through agent_env's multi-turn loop against the
   retrieval server(s), from the run's fresh source (`trainer/fresh.py`: the trainer's own
   processes, or rollout workers running ahead, whose late groups pass a staleness rule);
2. reward: exact match, computed by agent_env per response;
3. behaviour log-probs: every fresh token teacher-forced under the current weights
   (`gen_logprobs`), and the group advantages;
4. replay selection: the run's `GroupReplay` (`headroom_drift`) picks up to `R` stored groups
   by the arm's rule, re-scoring candidates teacher-forced (no generation, no retrieval);
5. one update on fresh + replayed rows (`headroom_drift.assemble_batch`, then
   `trainer.update.update_policy`: token-mean clipped loss, AdamW, gradient clipping, warmup),
   `grpo.updates_per_step` passes (1 by default); fresh tokens optionally weighted by
   truncated importance sampling of the sampler/trainer gap (`grpo.tis_cap`);
6. ingress: the step's fresh groups enter the FIFO buffer after the update;
7. the step's record (metrics.jsonl, TensorBoard). Around the steps (`trainer/loop.py`): a
   periodic held-out evaluation (eval.jsonl) and a checkpoint every `checkpoint.save_every`
   steps.

Precision: parameters, gradients and AdamW state are float32 (master weights); with
`model.compute_dtype: bfloat16` every forward (rollout with the shared hf module, behaviour
log-probs, replay scoring, the update) runs under `torch.autocast` in bf16. The gap between
the sampler's log-probs and the teacher-forced ones is logged each step (`logprob_gap_mean`,
`logprob_gap_max` over policy tokens): ~1e-6 with hf in fp32, real with vLLM or bf16.

Departures from the paper's setup: the behaviour log-probs come from teacher forcing, not
from the sampler (they agree up to float error with the hf backend; with vLLM they avoid the
sampler/trainer mismatch, which `grpo.tis_cap` can also correct); the held-out evaluation
during training is a small fixed subset (Mean@k, Best@k, greedy EM), the full evaluation is
`hdr eval`. `on_policy_larger` is not an arm but a config (`grpo.batch_prompts` 1.5x,
`arm: on_policy`); `on_policy_filtered` is `grpo.dynamic_sampling` (DAPO-style: zero-variance
groups dropped and refilled by extra fresh prompts, which count as fresh cost) with
`arm: on_policy`.

The loop around the steps is `trainer/loop.py`; setup, checkpoints and stop signals are
`trainer/run.py`; the fresh groups `trainer/fresh.py`; the update `trainer/update.py`; the
formulas and the replay lifecycle are the `headroom_drift` package; several processes are
`trainer/distributed.py`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from headroom_drift import LateDecision, Selection, StoredGroup, assemble_batch, masked_mean
from headroom_drift.groups import concat_left_padded
from headroom_drift.objective import logprob_gap, truncated_is_weights
from headroom_drift.staleness import on_time
from trainer.fresh import FreshBatch
from trainer.run import Run
from trainer.scoring import behaviour_groups, distinct_tokens, left_pad
from trainer.survey import survey_candidates, survey_record
from trainer.telemetry import StepCost, StepRecord, quantiles
from trainer.update import UpdateStats, update_policy

if TYPE_CHECKING:
    from agent_env.retrieval_client import ClientStats
    from agent_env.rollout import Trajectory

    Group = list[Trajectory]  # one prompt's G responses


# --- the step ----------------------------------------------------------------------------


def train_step(run: Run, step: int) -> StepRecord:
    """One GRPO step with replay; returns what it logs."""
    cfg, started = run.config, time.perf_counter()
    run.cost, run.phase_seconds, run.phase_bottom_tokens = StepCost(), {}, {}
    client_before = replace(run.client.stats)  # a copy of the counters
    # 1-2. rollout of b prompts x G responses, each rewarded by agent_env
    with run.phase("rollout"):
        batch = run.fresh.collect(step)
    # 3. behaviour log-probs and advantages (each process scores its share); a vLLM engine in
    # sleep mode hands its GPU memory to the trainer until the weight sync wakes it
    with run.phase("scoring"):
        run.generator.sleep()
        fresh, entropy = behaviour(run, batch.groups, step)
        sampled = sampler_logprobs(batch.groups, fresh)
        gap, tis = sampler_gap(
            *on_time(fresh, sampled, batch.lags), cfg.grpo.tis_cap, cfg.grpo.skip_zero_advantage
        )
        # late groups (asynchronous rollout) pass the staleness rule or go to the buffer
        late = admit_late_groups(run, fresh, sampled, batch.lags)
        fresh = late.trained
    # 4. replay selection: one decision, the same on every process (a survey beside it, at
    # the same weights, changes nothing and is timed apart)
    surveyed = survey_candidates(run, step)
    with run.phase("selection"):
        replay_tau = float(run.replay.gate.tau)  # the tau this step's scan admits by
        selection = run.replay.select(step, run.score, fresh)
        run.dist.agree(
            ([g.group_id for g in selection.groups], selection.swap_out),
            f"step {step}'s replay selection: selector {cfg.arm!r} is not a deterministic"
            " function of the buffer, the scores and the shared RNG, so it cannot run across"
            " processes; run it in one process",
        )
    # 5. one update on fresh + replayed (a swap selector leaves some fresh groups out)
    with run.phase("update"):
        kept = [k for k in range(len(fresh)) if k not in set(selection.swap_out)]
        trained = [fresh[k] for k in kept]
        kept_tis = None if tis is None else [tis[k] for k in kept]
        update_batch = assemble_batch(trained, selection.groups, selection.weights, kept_tis)
        update = update_policy(run, update_batch, run.scan_graphs(selection))
        run.generator.sync_weights(run.model)  # wakes a sleeping engine
        published = time.perf_counter()
        run.fresh.publish(run.model, step)  # version `step`, for rollout workers if any
        run.phase_seconds["publish"] = time.perf_counter() - published
    # 6. ingress after the update
    # (late groups over the staleness rule, if any, are stored beside the fresh ones)
    evicted = run.replay.ingest([*fresh, *late.to_buffer])  # counts the replays, then stores
    run.logs.groups_left(evicted, step)
    # 7. the step's record
    record_cost(run.cost, batch, trained, selection)
    record = step_record(run, step, started, batch, fresh, entropy, gap, selection, update,
                         client_before)  # fmt: skip
    record.async_rollout = late.record()
    if surveyed is not None:
        record.survey = survey_record(surveyed, selection)
    if run.phase_bottom_tokens:  # with a frozen bottom (`model.train_layers`)
        record.frozen_bottom = {f"bottom_tokens_{k}": v for k, v in run.phase_bottom_tokens.items()}
    if run.config.replay.gate == "adaptive":
        record.replay_gate = {
            "replay_tau": replay_tau,
            "replay_tau_next": float(run.replay.gate.tau),
            "replay_gate_measured": nan_to_none(run.replay.gate.last_measured),
        }
    if batch.timing is not None:
        record.async_rollout.update(worker_times(batch.timing, run.phase_seconds))
    return record


def nan_to_none(x: float) -> float | None:
    """JSON has no NaN: a gate that has measured nothing yet logs null."""
    return None if x != x else x


def worker_times(timing: list, seconds: dict[str, float]) -> dict[str, float]:
    """Where the step's rollout time went (asynchronous rollout): the trainer's wait for it
    and its weight publication, and the delivering workers' waits for a version, weight
    loads, rollouts and CPU seconds (summed over workers)."""
    gaps = [t.engine_sync_gap for t in timing if t.engine_sync_gap is not None]
    return {
        "time_wait_rollout": seconds["rollout"],
        "time_publish": seconds["publish"],
        "worker_wait_version_s": sum(t.wait_version_s for t in timing),
        "worker_load_weights_s": sum(t.load_weights_s for t in timing),
        "worker_rollout_s": sum(t.rollout_s for t in timing),
        "worker_cpu_s": sum(t.cpu_s for t in timing),
        "worker_engine_sync_gap": max(gaps) if gaps else None,  # vllm workers' weight check
    }


# --- 3. behaviour log-probs, and the sampler's beside them --------------------------------


def behaviour(run: Run, groups: list[Group], step: int) -> tuple[list[StoredGroup], float]:
    """The fresh groups as StoredGroups: behaviour log-probs teacher-forced under the current
    weights and the group advantages (`scoring.behaviour_groups`), and the mean token
    entropy. Each process scores its round-robin share; every process gets all of them in
    step order (ids by step index), and the ledger's behaviour tokens of all processes."""
    cfg = run.config
    dealt = run.dist.share(len(groups))
    scored, entropy, forwarded = behaviour_groups(
        run.model,
        [groups[i] for i in dealt],
        step,
        dealt,
        cfg.grpo.score_chunk,
        cfg.rollout.temperature,
        run.autocast,
        skip_uniform=cfg.grpo.skip_zero_advantage,
    )
    if run.dist.world == 1:
        run.cost.behaviour_tf_tokens += forwarded
        return scored, entropy
    tokens = sum(g.num_tokens for g in scored)
    totals = run.dist.sum({"entropy": entropy * tokens, "tokens": tokens, "forwarded": forwarded})
    run.cost.behaviour_tf_tokens += int(totals["forwarded"])
    pairs = [p for part in run.dist.all_gather(list(zip(dealt, scored, strict=True))) for p in part]
    fresh = [g for _, g in sorted(pairs, key=lambda p: p[0])]
    return fresh, totals["entropy"] / max(totals["tokens"], 1.0)


def admit_late_groups(
    run: Run, fresh: list[StoredGroup], sampled: list[Tensor], lags: list[int] | None
) -> LateDecision:
    """The configured staleness rule over the step's fresh groups (`lags` None: the trainer
    rolled them out itself, all on time); the late groups' teacher-forced tokens move from the
    ledger's behaviour tokens to its gate tokens."""
    if lags is None:
        return LateDecision(list(fresh), [], 0, None)
    gate_tokens = distinct_tokens([g for g, lag in zip(fresh, lags, strict=True) if lag > 0])
    run.cost.gate_tf_tokens += gate_tokens
    run.cost.behaviour_tf_tokens -= gate_tokens
    return run.replay.admit_late(fresh, sampled, lags)


def sampler_logprobs(groups: list[Group], fresh: list[StoredGroup]) -> list[Tensor]:
    """Each fresh group's sampler-reported log-probs, aligned with its `input_ids` `[G, T_g]`
    (0 off the policy tokens)."""
    out = []
    for group, stored in zip(groups, fresh, strict=True):
        rows = [[0.0] * len(t.prompt_ids) + list(t.sampler_logprobs) for t in group]
        out.append(left_pad(rows, dtype=torch.float32)[:, -stored.input_ids.shape[1] :])
    return out


def sampler_gap(
    fresh: list[StoredGroup],
    sampled: list[Tensor],
    tis_cap: float | None,
    skip_uniform: bool = False,
) -> tuple[dict[str, float | None], list[Tensor] | None]:
    """The step's sampler/trainer log-prob gap (metrics; None without scored fresh groups)
    and, with `tis_cap`, each fresh group's truncated importance weights `[G, T_g]`.
    `skip_uniform`: groups whose advantages are all 0 were not scored (`behaviour_groups`):
    they are left out of the metrics and weighted 1 (they train on no token)."""
    measured = [not (skip_uniform and g.all_zero_advantage) for g in fresh]
    if not any(measured):
        none = {"logprob_gap_mean": None, "logprob_gap_max": None}
        return none, [torch.ones_like(g.gen_logprobs) for g in fresh] if tis_cap else None
    scored = [(g, s) for g, s, m in zip(fresh, sampled, measured, strict=True) if m]
    trainer_lp = concat_left_padded([g.gen_logprobs for g, _ in scored])
    sampler_lp = concat_left_padded([s for _, s in scored])
    mask = concat_left_padded([g.loss_mask for g, _ in scored])
    mean, worst = logprob_gap(trainer_lp, sampler_lp, mask)
    metrics = {"logprob_gap_mean": float(mean), "logprob_gap_max": float(worst)}
    if tis_cap is None:
        return metrics, None
    weights = [
        truncated_is_weights(g.gen_logprobs, s, g.loss_mask, tis_cap)
        if m
        else torch.ones_like(g.gen_logprobs)
        for g, s, m in zip(fresh, sampled, measured, strict=True)
    ]
    w = concat_left_padded([w for w, m in zip(weights, measured, strict=True) if m])
    metrics["is_weight_mean"] = float(masked_mean(w, mask))
    metrics["is_capped_frac"] = float(masked_mean((w >= tis_cap).float(), mask))
    return metrics, weights


# --- 7. the step's record ------------------------------------------------------------------


def step_record(
    run: Run,
    step: int,
    started: float,
    batch: FreshBatch,
    fresh: list[StoredGroup],
    entropy: float,
    gap: dict[str, float | None],
    sel: Selection,
    update: UpdateStats,
    client_before: ClientStats,
) -> StepRecord:
    """What the step logs, and the run's counters moved on by it. Arms that do not scan
    (replay_recency, the sampling rules) get the admitted groups' drift and refreshed
    headroom from the update's first forward pass (same weights)."""
    from agent_env.rewards import exact_match

    trajs, stats, seconds = batch.trajectories, run.client.stats, run.phase_seconds
    env_calls = sum(r.env_calls for r in batch.rollouts)
    run.counters.env_calls_total += env_calls
    run.counters.search_calls_total += run.cost.search_calls
    run.counters.billed_search_calls_total += run.cost.billed_search_calls
    run.counters.cached_search_calls_total += run.cost.cached_search_calls
    run.counters.wall_time_total += time.perf_counter() - started
    scanned = sel.scanned > 0
    return StepRecord(
        step=step,
        reward_mean=float(np.mean([t.reward for t in trajs])),
        em_mean=float(np.mean([exact_match(t.answer, t.example.golden_answers) for t in trajs])),
        entropy=entropy,
        **gap,
        loss=update.loss,
        grad_norm=update.grad_norm,
        kl=update.kl,
        lr=run.scheduler.get_last_lr()[0],
        fresh_tokens=sum(g.num_tokens for g in fresh),
        replay_tokens=sum(g.num_tokens for g in sel.groups),
        replayed_groups=len(sel.groups),
        scanned_groups=sel.scanned,
        acceptance_rate=sel.acceptance_rate if scanned else None,
        drift_scanned_q=quantiles(sel.drift_scanned),
        drift_admitted_q=quantiles(sel.drift_admitted if scanned else update.replay_drift),
        headroom_scanned_q=quantiles(sel.headroom_scanned),
        headroom_admitted_q=quantiles(
            sel.headroom_refreshed if scanned else update.replay_headroom
        ),
        replay_ages=[step - g.entered_step for g in sel.groups],
        replay_counts=[g.replay_count for g in sel.groups],
        headroom_stored=sel.headroom_stored,
        headroom_refreshed=sel.headroom_refreshed if scanned else update.replay_headroom,
        buffer_size=len(run.replay),
        env_calls=env_calls,
        env_calls_total=run.counters.env_calls_total,
        search_calls=run.cost.search_calls,
        search_calls_total=run.counters.search_calls_total,
        billed_search_calls_total=run.counters.billed_search_calls_total,
        cached_search_calls_total=run.counters.cached_search_calls_total,
        dropped_groups=sum(len(r.dropped) for r in batch.rollouts),
        # this step's retrieval trouble: time paused in outages (nothing lost), queries cut
        # to length, queries that failed (their trajectories are marked failed)
        retrieval_outage_s=stats.outage_s - client_before.outage_s,
        retrieval_outages=stats.outages - client_before.outages,
        retrieval_truncated_queries=stats.truncated_queries - client_before.truncated_queries,
        retrieval_failed_queries=stats.failed_queries - client_before.failed_queries,
        time_generation=sum(r.gen_time for r in batch.rollouts),
        time_retrieval=sum(r.retrieval_time for r in batch.rollouts),
        time_scoring=seconds["scoring"],
        time_selection=seconds["selection"],
        time_update=seconds["update"],
        time_collectives=run.dist.take_collective_time(),
        time_step=time.perf_counter() - started,
        wall_time_total=run.counters.wall_time_total,
        world_size=run.dist.world,
        fresh_group_ids=[g.group_id for g in fresh],
        replayed_group_ids=[g.group_id for g in sel.groups],
        cost=run.cost,
    )


def record_cost(
    cost: StepCost, batch: FreshBatch, trained: list[StoredGroup], sel: Selection
) -> None:
    """Fill the step's ledger from what was rolled out, updated on and selected (the
    teacher-forced tokens and CPU seconds were counted as they happened)."""
    trajs = batch.spent
    cost.prompt_tokens = sum(len(t.prompt_ids) for t in trajs)
    cost.generated_tokens = sum(sum(t.loss_mask) for t in trajs)
    cost.observation_tokens = sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajs)
    cost.fresh_groups = sum(len(r.groups) + len(r.dropped) for r in batch.rollouts)
    cost.search_calls = sum(t.searches for t in trajs)
    cost.billed_search_calls = batch.billed_searches
    cost.cached_search_calls = batch.cached_searches
    cost.env_requests = sum(r.env_calls for r in batch.rollouts)
    cost.passages = batch.passages
    cost.env_wait_s = sum(r.retrieval_time for r in batch.rollouts)
    groups = trained + sel.groups
    cost.update_groups = len(groups)
    cost.informative_groups = sum(not g.all_zero_advantage for g in groups)
    cost.informative_tokens = sum(
        int(g.loss_mask[g.advantages != 0].sum()) for g in groups
    )  # rows with A != 0
    cost.replayed_groups = len(sel.groups)
    cost.scanned_groups = sel.scanned
