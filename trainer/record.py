"""What a step logs, derived in one place from what it did (`trainer.step.StepOutcome`): the
metrics line (`StepRecord`) with its cost ledger (`StepCost`), and the run's totals moved on.
`log_step` writes them wherever the run logs (`RunLogs`: metrics.jsonl, TensorBoard, W&B),
beside the groups that left the buffer (groups.jsonl).

Rules that do not scan (replay_recency, the sampling rules) get the admitted groups' drift and
refreshed headroom from the update's first forward pass (same weights).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from headroom_drift import Selection, StoredGroup
from trainer.run import Run
from trainer.scoring import distinct_tokens
from trainer.step import StepOutcome
from trainer.survey import survey_record
from trainer.telemetry import StepCost, StepRecord, quantiles

if TYPE_CHECKING:
    from agent_env.retrieval_client import ClientStats


def log_step(run: Run, outcome: StepOutcome) -> StepRecord:
    """The step's record, written to the run's logs (rank 0's; the others' are silent)."""
    record = step_record(run, outcome)
    run.logs.groups_left(outcome.evicted, outcome.step)
    run.logs.step(record.as_dict())
    return record


def step_record(run: Run, o: StepOutcome) -> StepRecord:
    """The step's metrics line; the run's totals (`run.counters`) move on by the step."""
    from agent_env.rewards import exact_match

    trajs, sel, update, cost = o.batch.trajectories, o.selection, o.update, step_cost(o)
    totals = run.counters
    totals.env_calls_total += cost.env_requests
    totals.search_calls_total += cost.search_calls
    totals.billed_search_calls_total += cost.billed_search_calls
    totals.cached_search_calls_total += cost.cached_search_calls
    totals.wall_time_total += o.seconds
    scanned, seconds = sel.scanned > 0, o.clock.seconds
    record = StepRecord(
        step=o.step,
        reward_mean=float(np.mean([t.reward for t in trajs])),
        em_mean=float(np.mean([exact_match(t.answer, t.example.golden_answers) for t in trajs])),
        entropy=o.entropy,
        **o.gap,
        loss=update.loss,
        grad_norm=update.grad_norm,
        kl=update.kl,
        lr=run.scheduler.get_last_lr()[0],
        fresh_tokens=sum(g.num_tokens for g in o.fresh),
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
        replay_ages=[o.step - g.entered_step for g in sel.groups],
        replay_counts=[g.replay_count for g in sel.groups],
        headroom_stored=sel.headroom_stored,
        headroom_refreshed=sel.headroom_refreshed if scanned else update.replay_headroom,
        buffer_size=len(run.replay),
        env_calls=cost.env_requests,
        env_calls_total=totals.env_calls_total,
        search_calls=cost.search_calls,
        search_calls_total=totals.search_calls_total,
        billed_search_calls_total=totals.billed_search_calls_total,
        cached_search_calls_total=totals.cached_search_calls_total,
        dropped_groups=sum(len(r.dropped) for r in o.batch.rollouts),
        **retrieval_trouble(*o.retrieval),
        time_generation=sum(r.gen_time for r in o.batch.rollouts),
        time_retrieval=sum(r.retrieval_time for r in o.batch.rollouts),
        time_scoring=seconds["scoring"],
        time_selection=seconds["selection"],
        time_update=seconds["update"],
        time_collectives=run.dist.take_collective_time(),
        time_step=o.seconds,
        wall_time_total=totals.wall_time_total,
        world_size=run.dist.world,
        fresh_group_ids=[g.group_id for g in o.fresh],
        replayed_group_ids=[g.group_id for g in sel.groups],
        cost=cost,
        async_rollout=o.late.record(),
    )
    if o.survey is not None:
        record.survey = survey_record(o.survey, sel)
    if o.clock.bottom_tokens:  # with a frozen bottom (`model.train_layers`)
        record.frozen_bottom = {f"bottom_tokens_{k}": v for k, v in o.clock.bottom_tokens.items()}
    if run.config.replay.gate == "adaptive":
        tau, tau_next, measured = o.gate
        record.replay_gate = {
            "replay_tau": tau,
            "replay_tau_next": tau_next,
            "replay_gate_measured": None if measured != measured else measured,  # NaN: null
        }
    if o.batch.timing is not None:
        record.async_rollout.update(worker_times(o.batch.timing, seconds))
    return record


def step_cost(o: StepOutcome) -> StepCost:
    """The step's cost ledger: what was rolled out, scored, selected and updated on."""
    batch, trajs, cpu = o.batch, o.batch.spent, o.clock.cpu
    # the late groups' teacher-forced pass is the staleness gate's, not the behaviour's
    lags = batch.lags or [0] * len(o.scored)
    gate_tokens = distinct_tokens([g for g, lag in zip(o.scored, lags, strict=True) if lag > 0])
    return StepCost(
        prompt_tokens=sum(len(t.prompt_ids) for t in trajs),
        generated_tokens=sum(sum(t.loss_mask) for t in trajs),
        observation_tokens=sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajs),
        behaviour_tf_tokens=o.behaviour_tokens - gate_tokens,
        scan_tf_tokens=o.scan_tokens,
        gate_tf_tokens=gate_tokens,
        update_tf_tokens=o.update.forwarded_tokens,
        fresh_groups=sum(len(r.groups) + len(r.dropped) for r in batch.rollouts),
        search_calls=sum(t.searches for t in trajs),
        billed_search_calls=batch.billed_searches,
        cached_search_calls=batch.cached_searches,
        env_requests=sum(r.env_calls for r in batch.rollouts),
        passages=batch.passages,
        **update_counts(o.trained, o.selection),
        env_wait_s=sum(r.retrieval_time for r in batch.rollouts),
        cpu_rollout_s=cpu.get("rollout", 0.0),
        cpu_scoring_s=cpu.get("scoring", 0.0),
        cpu_selection_s=cpu.get("selection", 0.0),
        cpu_update_s=cpu.get("update", 0.0),
    )


def update_counts(trained: list[StoredGroup], sel: Selection) -> dict[str, int]:
    """The ledger's groups of the update: fresh + replayed, those with some non-zero
    advantage and their policy tokens (rows with A != 0), the replayed and scanned ones."""
    groups = trained + sel.groups
    return {
        "update_groups": len(groups),
        "informative_groups": sum(not g.all_zero_advantage for g in groups),
        "informative_tokens": sum(int(g.loss_mask[g.advantages != 0].sum()) for g in groups),
        "replayed_groups": len(sel.groups),
        "scanned_groups": sel.scanned,
    }


def retrieval_trouble(before: ClientStats, after: ClientStats) -> dict[str, Any]:
    """The step's retrieval trouble: time paused in outages (nothing lost), queries cut to
    length, queries that failed (their trajectories are marked failed)."""
    return {
        "retrieval_outage_s": after.outage_s - before.outage_s,
        "retrieval_outages": after.outages - before.outages,
        "retrieval_truncated_queries": after.truncated_queries - before.truncated_queries,
        "retrieval_failed_queries": after.failed_queries - before.failed_queries,
    }


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
