"""TRL's GRPO batch layout and hdr's rows, both ways (pure tensor code).

TRL (`GRPOTrainer._generate_and_score_completions`, 1.16) hands the update a dict of a left-padded
prompt block `prompt_ids`/`prompt_mask` `[B, P]` beside a right-padded completion block
`completion_ids`/`completion_mask` `[B, C]`, with per-completion-token tensors `[B, C]`
(`tool_mask`: 1 on model tokens, `old_per_token_logps`, `sampling_per_token_logps`,
`importance_sampling_ratio`, `ref_per_token_logps`) and `advantages` `[B]`. hdr keeps a row
as one left-padded sequence, prompt then response, with a loss mask and log-probs aligned
with its tokens (`headroom_drift.StoredGroup`).

- `rows_from_trl`: TRL's two blocks -> hdr's left-padded rows (each row's real prompt tokens
  followed by its real completion tokens), the completion tensors moved to their tokens'
  columns (0 on the prompt and the padding).
- `trl_inputs`: hdr's `Rows` (`headroom_drift.Batch.rows`) -> the dict TRL's `compute_loss`
  reads. Every row stays one left-padded sequence: the prompt block is the columns before the
  first policy token of any row, the completion block the rest, and `tool_mask` carries the
  loss mask, so prompt tokens of other rows that fall in the completion block never count.
  TRL's forward does not pass position ids, so a left-padded row sees positions shifted by its
  padding; rotary embeddings depend on position differences only, which keeps the log-probs
  equal to hdr's teacher forcing up to float error (tests/trainer/test_trl.py measures it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

# TRL's per-completion-token tensors that hdr carries through replay (a replayed row gets its
# own values, see trainer/integrations/trl.py)
PER_TOKEN_KEYS = (
    "sampling_per_token_logps", "importance_sampling_ratio", "ref_per_token_logps",
    "old_per_token_logps",
)  # fmt: skip


@dataclass
class TRLRows:
    """TRL's batch as hdr's rows: `[B, T]` each, left padded (T = P + C)."""

    input_ids: Tensor  # (B, T) int64
    attention_mask: Tensor  # (B, T) int64
    loss_mask: Tensor  # (B, T) float32: completion_mask * tool_mask on completion tokens
    per_token: dict[str, Tensor] = field(default_factory=dict)  # (B, T) float32, by TRL's key


def left_align(values: Tensor, shift: Tensor) -> Tensor:
    """Move each row `i` of `values` `[B, T]` right by `shift[i]` columns, filling with 0:
    `out[i, j] = values[i, j - shift[i]]` for `j >= shift[i]`."""
    T = values.shape[1]
    source = torch.arange(T, device=values.device).unsqueeze(0) - shift.unsqueeze(1)  # (B, T)
    moved = values.gather(1, source.clamp(min=0))
    return torch.where(source >= 0, moved, torch.zeros_like(moved))


def rows_from_trl(batch: Mapping[str, Tensor]) -> TRLRows:
    """hdr's rows from TRL's generation batch (on the CPU). A completion's real tokens are the
    leading 1s of its `completion_mask` (TRL zeroes the whole row for a truncated completion
    under `mask_truncated_completions`: that row keeps its prompt and no policy token)."""
    prompt_ids, prompt_mask = batch["prompt_ids"].cpu(), batch["prompt_mask"].cpu().long()
    completion_ids = batch["completion_ids"].cpu()
    completion_mask = batch["completion_mask"].cpu().long()
    B, P = prompt_ids.shape
    C = completion_ids.shape[1]
    shift = C - completion_mask.sum(dim=1)  # (B,): right padding of each completion
    tool_mask = batch.get("tool_mask")
    policy = completion_mask if tool_mask is None else completion_mask * tool_mask.cpu().long()
    on_prompt = torch.zeros(B, P)

    def full(values: Tensor) -> Tensor:  # (B, C) completion values -> (B, T), left aligned
        if values.shape[1] == 1:  # a sequence-level value (TRL's sequence_* IS modes)
            values = values.expand(B, C)
        return left_align(torch.cat([on_prompt, values.cpu().float()], dim=1), shift)

    return TRLRows(
        input_ids=left_align(torch.cat([prompt_ids, completion_ids], dim=1), shift),
        attention_mask=left_align(torch.cat([prompt_mask, completion_mask], dim=1), shift),
        loss_mask=full(policy.float()),
        per_token={k: full(batch[k]) for k in PER_TOKEN_KEYS if batch.get(k) is not None},
    )


def completion_start(loss_mask: Tensor) -> int:
    """The first column holding a policy token in any row (at least 1: column 0 has no
    token before it to be predicted from)."""
    used = (loss_mask.sum(dim=0) > 0).nonzero()
    return max(1, int(used[0])) if len(used) else loss_mask.shape[1] - 1


def trl_inputs(
    input_ids: Tensor,
    attention_mask: Tensor,
    loss_mask: Tensor,
    advantages: Tensor,
    old_logprobs: Tensor,
    num_items_in_batch: Tensor,
    per_token: Mapping[str, Tensor] | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, Tensor]:
    """The dict TRL's `GRPOTrainer.compute_loss` reads, from hdr's left-padded rows
    (`[N, T]` each, `advantages` `[N]`, `per_token` values `[N, T]` by TRL's key, all aligned
    with `input_ids`). `num_items_in_batch`: the policy tokens of the whole update, summed over
    processes (TRL's token-mean denominator under `loss_type` dapo)."""
    s = completion_start(loss_mask)
    out = {
        "prompt_ids": input_ids[:, :s],
        "prompt_mask": attention_mask[:, :s],
        "completion_ids": input_ids[:, s:],
        "completion_mask": attention_mask[:, s:],
        "tool_mask": loss_mask[:, s:].long(),
        "old_per_token_logps": old_logprobs[:, s:].float(),
        "advantages": advantages.float(),
        **{k: v[:, s:].float() for k, v in (per_token or {}).items()},
    }
    out = {k: v.to(device) for k, v in out.items()}
    out["num_items_in_batch"] = num_items_in_batch.to(device)
    return out
