"""One GRPO step with Headroom-Drift Replay: `train_step(run, step) -> StepRecord`.

The method is the paper's ("Headroom-Drift Replay: A Primitive for Principled Replay Control
in GRPO", arXiv 2609.03941). One step, top to bottom (`train_step`; docs/design.md):
1. rollout: `b` prompts, `G` responses each, through agent_env's multi-turn loop against the
   retrieval server(s), from the run's fresh source (`trainer/fresh.py`: the trainer's own
   processes, or rollout workers running ahead, whose late groups pass a staleness rule);
2. reward: exact match, computed by agent_env per response;
3. behaviour log-probs: every fresh token teacher-forced under the current weights
   (`gen_logprobs`), and the group advantages;
4. replay selection: the arm's registered selector picks up to `R` stored groups, re-scoring
   candidates teacher-forced (no generation, no retrieval);
5. one update on fresh + replayed rows (`assemble_batch`, then `update_policy`: token-mean
   clipped loss, AdamW, gradient clipping, warmup), `grpo.updates_per_step` passes (1 by
   default); fresh tokens optionally weighted by truncated importance sampling of the
   sampler/trainer gap (`grpo.tis_cap`);
6. ingress: the step's fresh groups enter the FIFO buffer after the update;
7. the step's record (metrics.jsonl, TensorBoard). Around the steps (`trainer/train.py`): a
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

The run around the steps is `trainer/train.py`; setup, checkpoints and stop signals are
`trainer/run.py`; the fresh groups `trainer/fresh.py`; the formulas are `trainer/grpo.py` and
`trainer/replay.py`; several processes are `trainer/distributed.py`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from trainer import distributed
from trainer.fresh import FreshBatch
from trainer.grpo import (
    kl_k3,
    logprob_gap,
    masked_mean,
    policy_loss,
    truncated_is_weights,
    weighted_advantages,
)
from trainer.replay import GroupTensors, Selection, StoredGroup, headroom, policy_drift
from trainer.run import Run
from trainer.scoring import (
    align,
    behaviour_groups,
    concat_left_padded,
    distinct_tokens,
    forward_logprobs,
    left_pad,
)
from trainer.staleness import STALENESS_RULES, LateDecision, admit_late, on_time
from trainer.telemetry import StepCost, StepRecord, quantiles

if TYPE_CHECKING:
    from agent_env.retrieval_client import ClientStats
    from agent_env.rollout import Trajectory

    Group = list[Trajectory]  # one prompt's G responses


# --- the step ----------------------------------------------------------------------------


def train_step(run: Run, step: int) -> StepRecord:
    """One GRPO step with replay; returns what it logs."""
    cfg, started = run.config, time.perf_counter()
    run.cost, run.phase_seconds = StepCost(), {}
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
        gap, tis = sampler_gap(*on_time(fresh, sampled, batch.lags), cfg.grpo.tis_cap)
        # late groups (asynchronous rollout) pass the staleness rule or go to the buffer
        late = admit_late_groups(run, fresh, sampled, batch.lags)
        fresh = late.trained
    # 4. replay selection: one decision, the same on every process
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
    a = run.config.async_rollout
    gate_tokens = distinct_tokens([g for g, lag in zip(fresh, lags, strict=True) if lag > 0])
    run.cost.gate_tf_tokens += gate_tokens
    run.cost.behaviour_tf_tokens -= gate_tokens
    rule, keep = STALENESS_RULES.get(a.rule), a.over_gate == "buffer"
    norm = run.config.replay.drift_norm
    return admit_late(rule, run.staleness_gate, fresh, sampled, lags, a.max_lag, norm, keep)


def sampler_logprobs(groups: list[Group], fresh: list[StoredGroup]) -> list[Tensor]:
    """Each fresh group's sampler-reported log-probs, aligned with its `input_ids` `[G, T_g]`
    (0 off the policy tokens)."""
    out = []
    for group, stored in zip(groups, fresh, strict=True):
        rows = [[0.0] * len(t.prompt_ids) + list(t.sampler_logprobs) for t in group]
        out.append(left_pad(rows, dtype=torch.float32)[:, -stored.input_ids.shape[1] :])
    return out


def sampler_gap(
    fresh: list[StoredGroup], sampled: list[Tensor], tis_cap: float | None
) -> tuple[dict[str, float | None], list[Tensor] | None]:
    """The step's sampler/trainer log-prob gap (metrics; None without fresh groups) and, with
    `tis_cap`, each fresh group's truncated importance weights `[G, T_g]`."""
    if not fresh:
        return {"logprob_gap_mean": None, "logprob_gap_max": None}, [] if tis_cap else None
    trainer_lp = concat_left_padded([g.gen_logprobs for g in fresh])
    sampler_lp = concat_left_padded(sampled)
    mask = concat_left_padded([g.loss_mask for g in fresh])
    mean, worst = logprob_gap(trainer_lp, sampler_lp, mask)
    metrics = {"logprob_gap_mean": float(mean), "logprob_gap_max": float(worst)}
    if tis_cap is None:
        return metrics, None
    weights = [
        truncated_is_weights(g.gen_logprobs, s, g.loss_mask, tis_cap)
        for g, s in zip(fresh, sampled, strict=True)
    ]
    w = concat_left_padded(weights)
    metrics["is_weight_mean"] = float(masked_mean(w, mask))
    metrics["is_capped_frac"] = float(masked_mean((w >= tis_cap).float(), mask))
    return metrics, weights


# --- 5. the update -------------------------------------------------------------------------


@dataclass
class Batch:
    """One update's groups: fresh ones first, then replayed ones, each with its (weighted)
    advantages and, with TIS, its token weights. A pure value: `rows()` makes the tensors."""

    groups: list[StoredGroup]
    advantages: list[Tensor]  # per group [G]; a replayed group's scaled by its selection weight
    token_weights: list[Tensor] | None  # per group [G, T_g]: TIS on fresh tokens, 1 on replayed
    positions: list[int]  # each group's place in the whole update
    first_replayed: int  # the position where the replayed groups begin
    scale: float = 1.0  # 0: a process dealt no group runs one with zero weight

    @property
    def policy_tokens(self) -> Tensor:
        """The token mean's denominator: the policy tokens of every group (at least 1)."""
        return torch.stack([g.loss_mask.sum() for g in self.groups]).sum().clamp(min=1.0)

    def shard(self, rank: int, world: int) -> Batch:
        """This process's round-robin share of the groups. A process dealt none takes the
        first group with `scale` 0, so it still joins the gradient all-reduce."""
        dealt = list(range(rank, len(self.groups), world))
        take = dealt or [0]
        return Batch(
            groups=[self.groups[j] for j in take],
            advantages=[self.advantages[j] for j in take],
            token_weights=None if self.token_weights is None else [
                self.token_weights[j] for j in take
            ],
            positions=[self.positions[j] for j in take],
            first_replayed=self.first_replayed,
            scale=1.0 if dealt else 0.0,
        )  # fmt: skip

    def rows(self) -> Rows:
        """The groups' rows stacked to one width (`GroupTensors.stack`), with the advantages
        and token weights the update applies."""
        stacked = GroupTensors.stack(self.groups)
        weights = None
        if self.token_weights is not None:
            weights = concat_left_padded(self.token_weights)  # (N, T)
            weights = torch.where(stacked.loss_mask.bool(), weights, torch.ones_like(weights))
        fresh = [g for g, at in zip(self.groups, self.positions, strict=True)
                 if at < self.first_replayed]  # fmt: skip
        return Rows(
            input_ids=stacked.input_ids,
            attention_mask=stacked.attention_mask,
            loss_mask=stacked.loss_mask,
            gen_logprobs=stacked.gen_logprobs,
            rewards=stacked.rewards,
            advantages=torch.cat(self.advantages),  # (N,)
            token_weights=weights,
            num_fresh_rows=sum(len(g.input_ids) for g in fresh),
        )


@dataclass(kw_only=True)
class Rows(GroupTensors):
    """A batch's rows (`Batch.rows`): every group's tensors, `[N, T]` left padded to one width
    and `[N]`. `gen_logprobs` are the ratio's old log-probs (the behaviour ones of a fresh
    row, the stored ones of a replayed row); `advantages` as the update weighs them (a
    replayed group's scaled by its selection weight); `token_weights` 1 off the policy tokens.
    The first `num_fresh_rows` rows are fresh."""

    num_fresh_rows: int


def assemble_batch(
    fresh: list[StoredGroup],
    replayed: list[StoredGroup],
    weights: Sequence[float] = (),
    tis: list[Tensor] | None = None,
) -> Batch:
    """The update's batch from the fresh and replayed groups. `weights` (one per replayed
    group, a sampling selector's importance weights; empty: 1) scale the replayed groups'
    advantages (`weighted_advantages`); `tis` (one `[G, T_g]` per fresh group) weights the
    fresh tokens; a replayed group's tokens carry the weights stored with it
    (`StoredGroup.token_weights`, the fresh step's), 1 when it has none."""
    weights = list(weights) or [1.0] * len(replayed)
    token_weights = None
    if tis is not None or any(g.token_weights is not None for g in replayed):
        fresh_weights = tis if tis is not None else [torch.ones_like(g.gen_logprobs) for g in fresh]
        token_weights = [*fresh_weights, *(stored_weights(g) for g in replayed)]
    return Batch(
        groups=[*fresh, *replayed],
        advantages=[g.advantages for g in fresh]
        + [weighted_advantages(g.advantages, w) for g, w in zip(replayed, weights, strict=True)],
        token_weights=token_weights,
        positions=list(range(len(fresh) + len(replayed))),
        first_replayed=len(fresh),
    )


def stored_weights(group: StoredGroup) -> Tensor:
    """A stored group's per-token weights `[G, T]`: those its fresh step used, else 1."""
    if group.token_weights is None:
        return torch.ones_like(group.gen_logprobs)
    return group.token_weights


@dataclass
class UpdateStats:
    loss: float
    grad_norm: float
    kl: float
    replay_drift: list[float]  # per replayed group, under the pre-update weights
    replay_headroom: list[float]


@dataclass
class Chunk:
    """Rows forwarded (and backpropagated) together; `logprobs` when their forward is
    reused from the replay scan (aligned `[n, T]`, with the graph) instead of run here."""

    rows: Tensor  # (n,) row indices
    logprobs: Tensor | None = None


def update_policy(run: Run, batch: Batch, scanned: list[Tensor] | None = None) -> UpdateStats:
    """`grpo.updates_per_step` optimizer passes over `batch` in micro-batches whose gradients
    add up to the whole batch's token mean (each process trains on its share, gradients are
    summed across processes). `scanned`: see `pass_chunks`."""
    cfg = run.config.grpo
    run.cost.update_tf_tokens += sum(int(g.attention_mask.sum()) for g in batch.groups) * (
        cfg.updates_per_step
    )
    if not batch.groups:  # dynamic sampling kept nothing and nothing was replayed
        run.scheduler.step()
        return UpdateStats(0.0, 0.0, 0.0, [], [])
    total = batch.policy_tokens  # global: every process divides by the whole batch's tokens
    shard = batch.shard(run.dist.rank, run.dist.world)
    rows = shard.rows()
    first_pass = torch.zeros_like(rows.gen_logprobs)
    run.model.train()
    loss_sum = kl_sum = 0.0
    for p in range(cfg.updates_per_step):
        distributed.zero_gradients(run.optimizer, run.policy)
        work = pass_chunks(rows, cfg.micro_batch, scanned if p == 0 else None)
        for c, chunk in enumerate(work):
            share = float(rows.loss_mask[chunk.rows].sum() / total) * shard.scale
            with distributed.accumulate(run.policy, sync=c == len(work) - 1):
                loss, kl, lp = chunk_loss(run, rows, chunk)
                (loss * rows.loss_mask[chunk.rows].sum() / total * shard.scale).backward()
            loss_sum += float(loss.detach()) * share / cfg.updates_per_step
            kl_sum += kl * share / cfg.updates_per_step
            if p == 0:
                first_pass[chunk.rows] = lp
        grad_norm = distributed.clip_grad_norm(run.model, cfg.grad_clip)
        run.optimizer.step()
        distributed.zero_gradients(run.optimizer, run.policy)  # freed, or zeroed DDP views
    run.scheduler.step()
    run.model.eval()
    drift, refreshed_headroom = replay_telemetry(run, shard, first_pass)
    sums = run.dist.sum({"loss": loss_sum, "kl": kl_sum})
    return UpdateStats(sums["loss"], grad_norm, sums["kl"], drift, refreshed_headroom)


def micro_batches(attention_mask: Tensor, size: int) -> list[Chunk]:
    """Rows in chunks of `size`, shortest rows first (chunks pad little)."""
    order = torch.argsort(attention_mask.sum(dim=1), stable=True)
    return [Chunk(order[lo : lo + size]) for lo in range(0, len(order), size)]


def pass_chunks(rows: Rows, size: int, scanned: list[Tensor] | None = None) -> list[Chunk]:
    """One optimizer pass's chunks: micro-batches of every row; or, reusing the replay scan's
    forward (`scanned`, one per replayed group, the replayed rows being the last ones), the
    fresh rows in micro-batches and every replayed row in one chunk that carries its scan
    log-probs (the scan scored those groups together, so their graphs share one forward that
    only one backward may run through)."""
    if not scanned:
        return micro_batches(rows.attention_mask, size)
    replayed_rows = len(rows.input_ids) - rows.num_fresh_rows
    if sum(len(lp) for lp in scanned) != replayed_rows:
        raise ValueError(f"scanned log-probs cover {replayed_rows} replayed rows only partly")
    width = rows.input_ids.shape[1]
    padded = [F.pad(lp, (width - lp.shape[1], 0)) for lp in scanned]  # keeps the graphs
    reused = Chunk(torch.arange(rows.num_fresh_rows, len(rows.input_ids)), torch.cat(padded))
    return [*micro_batches(rows.attention_mask[: rows.num_fresh_rows], size), reused]


def chunk_loss(run: Run, rows: Rows, chunk: Chunk) -> tuple[Tensor, float, Tensor]:
    """Clipped policy loss (+ beta * k3 KL) of one chunk, its token mean, with grad; the KL
    and the chunk's log-probs `[n, T]` (detached, on the CPU) beside it."""
    cfg, device = run.config.grpo, next(run.model.parameters()).device
    picked = (rows.input_ids, rows.attention_mask, rows.loss_mask, rows.gen_logprobs)
    ids, attn, mask, old = (x[chunk.rows].to(device) for x in picked)
    adv = rows.advantages[chunk.rows].to(device)
    weights = None if rows.token_weights is None else rows.token_weights[chunk.rows].to(device)
    temperature = run.config.rollout.temperature
    if chunk.logprobs is None:
        with run.autocast():
            lp, _ = run.policy(ids, attn, mask, temperature)
        lp = align(lp).float()  # (n, T)
    else:
        lp = chunk.logprobs.to(device).float()
    loss = policy_loss(lp, old, adv, mask, cfg.eps_low, cfg.eps_high, weights)
    kl = 0.0
    if run.ref_model is not None:
        with torch.no_grad(), run.autocast():
            ref, _ = forward_logprobs(run.ref_model, ids, attn, mask, temperature)
        kl_t = kl_k3(lp, align(ref), mask)
        loss = loss + cfg.beta * kl_t
        kl = float(kl_t.detach())
    return loss, kl, lp.detach().float().cpu()


def replay_telemetry(run: Run, shard: Batch, first_pass: Tensor) -> tuple[list[float], list[float]]:
    """Drift and headroom of each replayed group under the pre-update policy (the update's
    first pass), in selection order; each process measures the groups it trained on."""
    found, row = [], 0
    for at, g in zip(shard.positions, shard.groups, strict=True):
        G, T = g.input_ids.shape
        if at >= shard.first_replayed and shard.scale:
            lp = first_pass[row : row + G, first_pass.shape[1] - T :]
            norm = run.config.replay.drift_norm
            drift = float(policy_drift(lp, g.gen_logprobs, g.loss_mask, norm))
            found.append((at, drift, float(headroom(lp, g.loss_mask, g.advantages))))
        row += G
    found = sorted(t for part in run.dist.all_gather(found) for t in part)
    return [d for _, d, _ in found], [h for _, _, h in found]


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
        buffer_size=len(run.buffer),
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
