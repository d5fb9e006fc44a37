"""Step 3 of a training step: the fresh groups' behaviour log-probs, teacher-forced under the
current weights (`behaviour`), the sampler's log-probs beside them (`sampler_logprobs`), and
the gap between the two with, under `grpo.tis_cap`, the truncated importance weights that
correct for it (`sampler_gap`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from headroom_drift import StoredGroup, masked_mean
from headroom_drift.groups import concat_left_padded
from headroom_drift.objective import logprob_gap, truncated_is_weights
from trainer.run import Run
from trainer.scoring import behaviour_groups, left_pad

if TYPE_CHECKING:
    from agent_env.rollout import Trajectory

    Group = list[Trajectory]  # one prompt's G responses


def behaviour(run: Run, groups: list[Group], step: int) -> tuple[list[StoredGroup], float, int]:
    """The fresh groups as StoredGroups: behaviour log-probs teacher-forced under the current
    weights and the group advantages (`scoring.behaviour_groups`), the mean token entropy,
    and the tokens forwarded. Each process scores its round-robin share; every process gets
    all of them in step order (ids by step index), and the tokens of all processes."""
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
        return scored, entropy, forwarded
    tokens = sum(g.num_tokens for g in scored)
    totals = run.dist.sum({"entropy": entropy * tokens, "tokens": tokens, "forwarded": forwarded})
    pairs = [p for part in run.dist.all_gather(list(zip(dealt, scored, strict=True))) for p in part]
    fresh = [g for _, g in sorted(pairs, key=lambda p: p[0])]
    return fresh, totals["entropy"] / max(totals["tokens"], 1.0), int(totals["forwarded"])


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
