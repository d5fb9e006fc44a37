"""Step 5 of a training step: one update on the fresh and replayed rows (`update_policy`).

`grpo.updates_per_step` optimizer passes (1 by default) over the step's batch
(`headroom_drift.Batch`), in micro-batches whose gradients add up to the whole batch's token
mean (`headroom_drift.policy_loss`, plus `beta` times the k3 KL to a reference when asked),
AdamW on float32 master weights, gradient clipping, the warmup schedule. Across processes each
trains a round-robin share of the groups and the gradients are summed. With
`replay.reuse_scan_forward` the first pass backpropagates through the replay scan's forward
instead of repeating it. Beside it, each replayed group's drift and headroom under the
pre-update weights (the first pass's log-probs), for the step's record.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from headroom_drift import Batch, Rows, headroom, kl_k3, policy_drift, policy_loss
from trainer import distributed
from trainer.frozen_bottom import attached
from trainer.run import Run
from trainer.scoring import align, forward_logprobs


@dataclass
class UpdateStats:
    loss: float
    grad_norm: float
    kl: float
    replay_drift: list[float]  # per replayed group, under the pre-update weights
    replay_headroom: list[float]
    forwarded_tokens: int = 0  # teacher-forced (forward + backward) over every pass


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
    forwarded = sum(int(g.attention_mask.sum()) for g in batch.groups)
    if cfg.skip_zero_advantage:  # fresh rows with advantage 0 are in no chunk (`pass_chunks`)
        fresh = batch.groups[: batch.first_replayed]
        forwarded -= sum(int(g.attention_mask[g.advantages == 0].sum()) for g in fresh)
    forwarded *= cfg.updates_per_step
    if not batch.groups:  # dynamic sampling kept nothing and nothing was replayed
        run.scheduler.step()
        return UpdateStats(0.0, 0.0, 0.0, [], [], forwarded)
    total = batch.policy_tokens  # global: every process divides by the whole batch's tokens
    shard = batch.shard(run.dist.rank, run.dist.world)
    if (bottom := attached(run.model)) is not None:  # kept from the behaviour pass and scans
        bottom.fill(run.model, forwarded_groups(shard, cfg.skip_zero_advantage))
    rows = shard.rows()
    first_pass = torch.zeros_like(rows.gen_logprobs)
    run.model.train()
    loss_sum = kl_sum = 0.0
    for p in range(cfg.updates_per_step):
        distributed.zero_gradients(run.optimizer, run.policy)
        work = pass_chunks(
            rows, cfg.micro_batch, scanned if p == 0 else None, cfg.skip_zero_advantage
        )
        if not work:  # every row skipped: the zero gradients they would have given
            zero_gradients_of(run.model)
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
    return UpdateStats(sums["loss"], grad_norm, sums["kl"], drift, refreshed_headroom, forwarded)


def forwarded_groups(batch: Batch, skip_zero: bool) -> list:
    """The groups of `batch` whose rows the update forwards: all, or with `skip_zero` all but
    the fresh ones whose advantages are all 0 (`pass_chunks`)."""
    return [
        g
        for at, g in zip(batch.positions, batch.groups, strict=True)
        if not (skip_zero and at < batch.first_replayed and g.all_zero_advantage)
    ]


def micro_batches(attention_mask: Tensor, size: int, among: Tensor | None = None) -> list[Chunk]:
    """Rows (all, or the indices `among`) in chunks of `size`, shortest rows first (chunks
    pad little)."""
    among = torch.arange(len(attention_mask)) if among is None else among
    order = among[torch.argsort(attention_mask[among].sum(dim=1), stable=True)]
    return [Chunk(order[lo : lo + size]) for lo in range(0, len(order), size)]


def pass_chunks(
    rows: Rows, size: int, scanned: list[Tensor] | None = None, skip_zero: bool = False
) -> list[Chunk]:
    """One optimizer pass's chunks: micro-batches of every row; or, reusing the replay scan's
    forward (`scanned`, one per replayed group, the replayed rows being the last ones), the
    fresh rows in micro-batches and every replayed row in one chunk that carries its scan
    log-probs (the scan scored those groups together, so their graphs share one forward that
    only one backward may run through). `skip_zero` (`grpo.skip_zero_advantage`): fresh rows
    whose advantage is 0 are in no chunk (their loss is 0; the token mean's denominator is
    the batch's, so it still counts them)."""
    fresh = torch.arange(rows.num_fresh_rows)
    if skip_zero:
        fresh = fresh[rows.advantages[: rows.num_fresh_rows] != 0]
    replayed = torch.arange(rows.num_fresh_rows, len(rows.input_ids))
    if not scanned:
        return micro_batches(rows.attention_mask, size, torch.cat([fresh, replayed]))
    if sum(len(lp) for lp in scanned) != len(replayed):
        raise ValueError(f"scanned log-probs cover {len(replayed)} replayed rows only partly")
    width = rows.input_ids.shape[1]
    padded = [F.pad(lp, (width - lp.shape[1], 0)) for lp in scanned]  # keeps the graphs
    return [*micro_batches(rows.attention_mask, size, fresh), Chunk(replayed, torch.cat(padded))]


def zero_gradients_of(model) -> None:
    """Zero gradients on every trained parameter: the optimizer steps on them as on the
    gradients of rows that all had loss 0 (AdamW's moments still move the weights)."""
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)


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
