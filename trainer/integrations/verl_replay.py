"""Headroom-Drift Replay's rows inside veRL 0.9.1's batch (`hdr[verl]`): the conversions
between veRL's `DataProto` rows and `headroom_drift.GroupReplay`'s groups.

veRL keeps a trajectory as a row: `prompts` `[N, P]` (left padded), `responses` `[N, R]`
(right padded), `input_ids` = both, `attention_mask`, `position_ids`, `response_mask` (1 on the
policy's tokens, 0 on tool answers and padding), `old_log_probs` (the log-probs under the
weights that took the step, the PPO ratio's denominator), `token_level_rewards` (the
outcome reward on the response's last token), `advantages` (GRPO: one value per row, on every
response token) and `uid` (the row's group). A GRPO group is the rows of one `uid`.

- `groups_from_batch(batch)`: after veRL's advantage step, one `GroupReplay.store(step, **g)`
  argument set per group, keyed as hdr keeps groups (`loss_mask` and the behaviour log-probs
  over the whole `input_ids`, zero on the prompt);
- `score_with(response_log_probs, prompt_length)`: GroupReplay's `score` from a function that
  gives the current policy's response log-probs of a `DataProto` (in veRL the actor worker
  group's `compute_log_prob`), so the drift scan runs as one of veRL's forward passes;
- `batch_from_groups(groups, prompt_length)`: the selected groups as veRL rows to add to the
  step's batch, with their stored behaviour log-probs as `old_log_probs` (the ratio's
  denominator of a replayed token, as hdr's loss has it) and their rewards placed as veRL's
  reward places them, so veRL's own GRPO advantage step gives them their stored advantages.

docs/integrations.md ("The replay primitive inside veRL") outlines where these sit in veRL's
v1 trainer step and what ran on the CPU (tests/trainer/test_verl_replay.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor
from verl.protocol import DataProto
from verl.utils.model import compute_position_id_with_mask

from headroom_drift import ScoreFn, StoredGroup


def groups_from_batch(batch: DataProto) -> list[dict]:
    """Each `uid` group of `batch` (in first-seen order) as `GroupReplay.store` keywords:
    `input_ids`, `attention_mask`, `loss_mask`, `logprobs` (veRL's `old_log_probs`),
    `rewards`, `advantages` and `group_id` (the uid)."""
    rows = batch.batch
    prompt_length = rows["prompts"].shape[1]
    response_mask = rows["response_mask"].float()
    pad = torch.zeros(len(batch), prompt_length)
    loss_mask = torch.cat([pad, response_mask], dim=1)
    logprobs = torch.cat([pad, rows["old_log_probs"].float() * response_mask], dim=1)
    rewards = rows["token_level_rewards"].float().sum(dim=-1)
    # GRPO writes a row's one advantage on each of its response tokens
    tokens = response_mask.sum(dim=-1).clamp(min=1)
    advantages = (rows["advantages"].float() * response_mask).sum(dim=-1) / tokens
    uids = batch.non_tensor_batch["uid"]
    groups = []
    for uid in dict.fromkeys(uids.tolist()):
        index = torch.as_tensor(np.flatnonzero(uids == uid))
        groups.append(
            {
                "input_ids": rows["input_ids"][index],
                "attention_mask": rows["attention_mask"][index],
                "loss_mask": loss_mask[index],
                "logprobs": logprobs[index],
                "rewards": rewards[index],
                "advantages": advantages[index],
                "group_id": str(uid),
            }
        )
    return groups


def batch_from_groups(groups: Sequence[StoredGroup], prompt_length: int) -> DataProto:
    """`groups` as veRL rows (the layout of the module docstring): `old_log_probs` their
    stored behaviour log-probs, each row's reward on its last response token, `uid` the
    group id."""
    input_ids = torch.cat([g.input_ids for g in groups])
    attention_mask = torch.cat([g.attention_mask for g in groups])
    response_mask = torch.cat([g.loss_mask for g in groups])[:, prompt_length:]
    old_log_probs = torch.cat([g.gen_logprobs for g in groups])[:, prompt_length:]
    response_attention = attention_mask[:, prompt_length:]
    last = (response_attention.cumsum(dim=-1) == response_attention.sum(-1, keepdim=True)) & (
        response_attention == 1
    )
    rewards = torch.cat([g.rewards for g in groups])
    token_level_rewards = last.float() * rewards.unsqueeze(-1)
    uids = [g.group_id for g in groups for _ in range(len(g.rewards))]
    return DataProto.from_dict(
        tensors={
            "prompts": input_ids[:, :prompt_length],
            "responses": input_ids[:, prompt_length:],
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
            "response_mask": response_mask,
            "old_log_probs": old_log_probs,
            "token_level_rewards": token_level_rewards,
        },
        non_tensors={"uid": np.array(uids, dtype=object)},
    )


def score_with(response_log_probs: Callable[[DataProto], Tensor], prompt_length: int) -> ScoreFn:
    """GroupReplay's `score(groups) -> [Tensor[G, T]]` from `response_log_probs(batch) ->
    Tensor[N, R]`, the current policy's log-probs of each row's response tokens (veRL: the
    actor's `compute_log_prob` on the rows), aligned back to each group's `input_ids`."""

    def score(groups: list[StoredGroup]) -> list[Tensor]:
        if not groups:
            return []
        rows = batch_from_groups(groups, prompt_length)
        with torch.no_grad():
            response = response_log_probs(rows).float() * rows.batch["response_mask"]
        scored, start = [], 0
        for group in groups:
            size = len(group.rewards)
            pad = torch.zeros(size, prompt_length)
            scored.append(torch.cat([pad, response[start : start + size]], dim=1))
            start += size
        return scored

    return score
