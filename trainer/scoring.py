"""Teacher-forced scoring: per-token log-probs (and entropy) of fixed token sequences.

One function serves three uses: the behaviour log-probs of a step's fresh groups (stored as
`gen_logprobs` by `behaviour_groups`, with the group advantages), the re-scoring of replay
candidates (no grad), and the update's forward pass (with grad). Rows are left padded;
position ids are `cumsum(attention_mask) - 1` so that a padded row sees the same positions as
an unpadded one, in generation and here alike.

Three economies:
- exact duplicate rows (a group's responses often share query and answer) are scored once;
- memory-bounded chunks of rows, each trimmed of the left-padding columns no row in it uses,
  rows sorted by length first so chunks pad little;
- the output layer (hidden -> vocabulary) runs only at positions whose next token is wanted
  (a policy token under `target_mask`), which on the tiny model halves the cost because 75%
  of a trajectory is retrieved text; and in slices of `HEAD_SLICE` positions, checkpointed
  under grad, so a large vocabulary never materialises all positions' logits at once.

Log-probs are of `softmax(logits / temperature)`, the distribution the sampler draws from.
Models with extra logit transforms (soft-capping, logit scales) are not covered.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

from headroom_drift import GroupTensors, StoredGroup, group_advantages, make_group, masked_mean
from headroom_drift.groups import concat_left_padded
from headroom_drift.objective import token_entropy
from trainer.frozen_bottom import attached, backbone

# Positions per output-layer slice: bounds the `[positions, vocabulary]` logits a forward
# holds (Qwen2.5's 151,936 entries x 4,096 positions are 2.5 GB per row in fp32).
HEAD_SLICE = 512


CallAgreement = Callable[[list[int]], list[int]]
"""Across processes whose engine gathers weights per module call (DeepSpeed ZeRO-3): takes
this process's output-layer calls per chunk of a scoring pass and returns the plan every
process runs, the elementwise max over processes, padded to the longest list (a no-grad
scoring pass then runs `len(plan)` backbone forwards and `plan[i]` output-layer calls in chunk
`i` on every process; dummy ones where a process has fewer)."""


def compute_context(model, dtype: str) -> contextlib.AbstractContextManager:
    """The forwards' context: bf16 (or fp16) autocast on the float32 weights when `dtype`
    asks (`model.compute_dtype`), else none."""
    if dtype == "float32":
        return contextlib.nullcontext()
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=getattr(torch, dtype))


def wanted_targets(attention_mask: Tensor, target_mask: Tensor | None = None) -> int:
    """Positions whose next token `forward_logprobs` scores for these rows (`[n, T]` each)."""
    real = attention_mask.bool()
    target = real if target_mask is None else target_mask.bool()
    return int((target[:, 1:] & real[:, 1:] & real[:, :-1]).sum())


def head_calls(attention_mask: Tensor, target_mask: Tensor | None = None) -> int:
    """Output-layer calls `forward_logprobs` makes for these rows (at least one)."""
    return max(1, math.ceil(wanted_targets(attention_mask, target_mask) / HEAD_SLICE))


def forward_logprobs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    target_mask: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    head_slices: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One forward pass over one chunk. Grad follows the caller's mode.

    `input_ids`, `attention_mask`, `target_mask`: `[n, T]`, left padded; `target_mask[i, t]`
    marks token `input_ids[i, t]` as wanted (defaults to every real token). Returns
    `logprobs [n, T-1]` = `log softmax(logits[:, t] / temperature)[input_ids[:, t+1]]` at the
    wanted targets and 0 elsewhere, and the same-shaped entropy (or None). `head_slices`
    (no grad): call the output layer that many times at least, the extra calls on one
    position whose result is dropped (`CallAgreement`).
    """
    n, T = input_ids.shape
    if target_mask is None:
        target_mask = attention_mask
    used = (attention_mask.sum(dim=0) > 0).nonzero()
    start = int(used[0]) if len(used) else T - 1  # first column any row uses
    ids, mask = input_ids[:, start:], attention_mask[:, start:]
    hidden = backbone(model, ids, mask)  # (n, T - start, H)
    real = mask.bool()
    # a target is wanted when marked, and real with a real token before it to predict it from
    wanted = target_mask[:, start + 1 :].bool() & real[:, 1:] & real[:, :-1]  # (n, T-start-1)
    head = model.get_output_embeddings()
    picked, targets = hidden[:, :-1][wanted], ids[:, 1:][wanted]  # (K, H), (K,)
    recompute = torch.is_grad_enabled() and len(targets) > HEAD_SLICE
    pieces = [
        _head_logprobs(head, picked[lo : lo + HEAD_SLICE], targets[lo : lo + HEAD_SLICE],
                       temperature, with_entropy, recompute)
        for lo in range(0, max(len(targets), 1), HEAD_SLICE)
    ]  # fmt: skip
    for _ in range(len(pieces), head_slices or 0):  # padding calls: same gathers as the others
        head(hidden[:1, -1])
    token_lp = torch.cat([lp for lp, _ in pieces])  # (K,)
    out = torch.zeros(n, T - 1, dtype=token_lp.dtype, device=token_lp.device)
    out[:, start:][wanted] = token_lp
    entropy = None
    if with_entropy:
        entropy = torch.zeros(n, T - 1, device=token_lp.device)
        entropy[:, start:][wanted] = torch.cat([e for _, e in pieces])
    return out, entropy


def sampler_logits(head, hidden: Tensor, temperature: float) -> Tensor:
    """The output layer's float32 logits `[k, V]` over `temperature`: the sampler's. At
    temperature 1 the division is skipped (it changes no bit, and on a large vocabulary it is
    a pass over every logit)."""
    logits = head(hidden).float()
    return logits if temperature == 1.0 else logits / temperature


def _head_logprobs(
    head, hidden: Tensor, targets: Tensor, temperature: float, with_entropy: bool, recompute: bool
):
    """Log-probs `[k]` of `targets` from `hidden` `[k, H]` through the output layer (and the
    entropy `[k]`, no grad, or None). `recompute`: checkpointed, the logits are recomputed in
    backward, so a backward pass holds one slice of them at a time. Otherwise the logits are
    computed once for both (on a large vocabulary the output layer is most of the cost)."""

    def logprobs(logits: Tensor, t: Tensor) -> Tensor:
        return torch.log_softmax(logits, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)

    def head_logprobs(h: Tensor, t: Tensor) -> Tensor:
        return logprobs(sampler_logits(head, h, temperature), t)

    if recompute:
        lp = torch.utils.checkpoint.checkpoint(head_logprobs, hidden, targets, use_reentrant=False)
        if not with_entropy:
            return lp, None
        with torch.no_grad():
            return lp, token_entropy(sampler_logits(head, hidden, temperature))
    logits = sampler_logits(head, hidden, temperature)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = token_entropy(logits)
    return logprobs(logits, targets), entropy


def token_logprobs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    target_mask: Tensor | None = None,
    chunk_size: int = 16,
    temperature: float = 1.0,
    with_entropy: bool = False,
    dedupe: bool = True,
    agree: CallAgreement | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Teacher-forced log-probs of `input_ids[:, 1:]`, in chunks of `chunk_size` rows.

    Arguments as `forward_logprobs`; returns `[N, T-1]` log-probs (0 off `target_mask`) and
    entropy (or None), on the CPU in the rows' original order. Rows that are exact duplicates
    (same ids, attention and target mask: a group's responses often are) are scored once when
    `dedupe`. Call under `torch.no_grad()` unless the graph is wanted (then memory is not
    bounded: the update chunks by itself). `agree` (no grad, several processes): every
    process runs the same number of forwards and output-layer calls (`CallAgreement`).
    """
    N, T = input_ids.shape
    if dedupe and N > 1:
        unique, inverse = unique_rows(input_ids, attention_mask, target_mask)
        if len(unique) < N:
            tm = None if target_mask is None else target_mask[unique]
            lp, ent = token_logprobs(
                model, input_ids[unique], attention_mask[unique], tm, chunk_size, temperature,
                with_entropy, dedupe=False, agree=agree,
            )  # fmt: skip
            return lp[inverse], None if ent is None else ent[inverse]
    device = next(model.parameters()).device
    lengths = attention_mask.sum(dim=-1)
    order = torch.argsort(lengths, stable=True)
    out = torch.zeros(N, T - 1)
    ent = torch.zeros(N, T - 1) if with_entropy else None
    chunks = [order[lo : lo + chunk_size] for lo in range(0, N, chunk_size)]
    plan = [None] * len(chunks)
    if agree is not None:
        plan = agree([
            head_calls(attention_mask[rows], None if target_mask is None else target_mask[rows])
            for rows in chunks
        ])  # fmt: skip
    for i, slices in enumerate(plan):
        if i >= len(chunks):  # this process has fewer chunks: a dummy forward, dropped
            dummy = torch.zeros(1, 2, dtype=torch.long, device=device)
            forward_logprobs(model, dummy, torch.ones_like(dummy), None, temperature,
                             head_slices=slices)  # fmt: skip
            continue
        rows = chunks[i]
        tm = None if target_mask is None else target_mask[rows].to(device)
        lp, e = forward_logprobs(
            model,
            input_ids[rows].to(device),
            attention_mask[rows].to(device),
            tm,
            temperature,
            with_entropy,
            head_slices=slices,
        )
        out[rows] = lp.float().cpu()
        if ent is not None:
            ent[rows] = e.float().cpu()
    return out, ent


def unique_rows(
    input_ids: Tensor, attention_mask: Tensor, target_mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Indices of the first occurrence of each distinct row, and each row's index into them."""
    parts = [input_ids.long(), attention_mask.long()]
    if target_mask is not None:
        parts.append(target_mask.long())
    key = torch.cat(parts, dim=1)  # (N, 3T)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)  # (N,): class of each row
    first = torch.full((int(inverse.max()) + 1,), len(key), dtype=torch.long)
    first = first.scatter_reduce(0, inverse, torch.arange(len(key)), reduce="amin")
    order = torch.argsort(first)  # classes in order of first appearance
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    return first[order], rank[inverse]


def left_pad(
    rows: Sequence[Sequence[int] | Tensor], pad_value: float = 0, dtype=torch.long
) -> Tensor:
    """Stack variable-length rows into `[N, max_len]`, padding on the left."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_value, dtype=dtype)
    for i, row in enumerate(rows):
        if len(row):
            out[i, width - len(row) :] = torch.as_tensor(row, dtype=dtype)
    return out


def align(logprobs: Tensor) -> Tensor:
    """`[N, T-1]` scores of `input_ids[:, 1:]` -> `[N, T]` aligned with `input_ids`."""
    return F.pad(logprobs, (1, 0))


def score_groups(
    model,
    groups: Sequence,
    chunk_size: int = 16,
    temperature: float = 1.0,
    with_grad: bool = False,
    agree: CallAgreement | None = None,
) -> list[Tensor]:
    """Current-policy log-probs of stored groups: one `[G, T_g]` tensor per group, aligned
    with its `input_ids` (0 off its loss mask). Usable as a replay `ScoreFn`. `with_grad`
    keeps each tensor's graph (for an update that reuses this forward); `agree`: see
    `token_logprobs` (a process with no group still joins the agreed forwards)."""
    if not groups:
        if agree is not None:
            token_logprobs(model, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2),
                           None, chunk_size, temperature, agree=agree)  # fmt: skip
        return []
    if (bottom := attached(model)) is not None:
        bottom.fill(model, groups)  # each group's frozen-bottom states, from its own rows
    ids = concat_left_padded([g.input_ids for g in groups])
    attn = concat_left_padded([g.attention_mask for g in groups])
    target = concat_left_padded([g.loss_mask for g in groups])
    with torch.set_grad_enabled(with_grad):
        lp, _ = token_logprobs(model, ids, attn, target, chunk_size, temperature, agree=agree)
    lp = align(lp)
    out, row = [], 0
    for g in groups:
        G, T = g.input_ids.shape
        out.append(lp[row : row + G, lp.shape[1] - T :] * g.loss_mask)
        row += G
    return out


def forwarded_tokens(
    input_ids: Tensor, attention_mask: Tensor, target_mask: Tensor | None = None
) -> int:
    """Real tokens `token_logprobs` (with `dedupe`) runs through the model for these rows:
    the attention-mask sum over distinct rows. `[N, T]` each -> int."""
    if len(input_ids) > 1:
        unique, _ = unique_rows(input_ids, attention_mask, target_mask)
        attention_mask = attention_mask[unique]
    return int(attention_mask.sum())


def distinct_tokens(groups: Sequence) -> int:
    """Real tokens `score_groups` runs through the model for `groups` (see `forwarded_tokens`)."""
    if not groups:
        return 0
    return forwarded_tokens(
        concat_left_padded([g.input_ids for g in groups]),
        concat_left_padded([g.attention_mask for g in groups]),
        concat_left_padded([g.loss_mask for g in groups]),
    )


def trajectory_rows(groups: Sequence[Sequence]) -> tuple[Tensor, Tensor, Tensor]:
    """Left-padded `input_ids`, `attention_mask`, `loss_mask` `[b*G, T]` of the trajectories'
    prompt + response, group after group."""
    trajs = [t for group in groups for t in group]
    ids = left_pad([t.prompt_ids + t.response_ids for t in trajs])
    attn = left_pad([[1] * (len(t.prompt_ids) + len(t.response_ids)) for t in trajs])
    mask = left_pad([[0] * len(t.prompt_ids) + list(t.loss_mask) for t in trajs])
    return ids, attn, mask


def behaviour_groups(
    model,
    groups: Sequence[Sequence],
    step: int,
    indices: Sequence[int],
    chunk_size: int,
    temperature: float,
    compute=contextlib.nullcontext,
    skip_uniform: bool = False,
) -> tuple[list[StoredGroup], float, int]:
    """A step's fresh groups (each one prompt's trajectories) as StoredGroups: behaviour
    log-probs teacher-forced under the current weights (`behaviour_logprobs`), rewards from the
    trajectories, group advantages, and each named `s{step}/{index}/{example id}` by its index
    in the step. Also the mean token entropy and the tokens forwarded (`behaviour_logprobs`).
    `skip_uniform` (`grpo.skip_zero_advantage`): a group whose advantages are all 0 is not
    forwarded; its log-probs stay 0 (nothing reads them: it trains on no token and is not
    stored) and the entropy is the scored groups'."""
    if not groups:
        return [], 0.0, 0
    ids, attn, mask = trajectory_rows(groups)
    rewards = torch.tensor([[t.reward for t in group] for group in groups])  # (b, G)
    advantages = group_advantages(rewards)  # (b, G)
    names = [f"s{step}/{indices[k]}/{group[0].example.id}" for k, group in enumerate(groups)]
    G = len(groups[0])
    scored = [k for k in range(len(groups)) if not skip_uniform or bool(advantages[k].any())]
    rows = torch.cat([torch.arange(k * G, (k + 1) * G) for k in scored]) if scored else None
    lp, entropy, forwarded = torch.zeros(mask.shape), 0.0, 0  # (b*G, T) float32
    if rows is not None:
        if (bottom := attached(model)) is not None:  # the groups' own rows, as they are stored
            stack = GroupTensors(ids, attn, mask, lp, rewards.flatten(), rewards.flatten())
            bottom.fill(model, [stack.take(slice(k * G, (k + 1) * G)) for k in scored])
        lp[rows], entropy, forwarded = behaviour_logprobs(
            model, ids[rows], attn[rows], mask[rows], chunk_size, temperature, compute
        )
    stack = GroupTensors(ids, attn, mask, lp, rewards.flatten(), advantages.flatten())
    return groups_of_rows(stack, step, names), entropy, forwarded


def behaviour_logprobs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    loss_mask: Tensor,
    chunk_size: int,
    temperature: float,
    compute=contextlib.nullcontext,
    dedupe: bool = True,
    agree: CallAgreement | None = None,
) -> tuple[Tensor, float, int]:
    """The behaviour log-probs of rows (`[N, T]` each, left padded): teacher-forced under the
    current weights (no grad, under the `compute` context, e.g. autocast), aligned with
    `input_ids`, 0 off `loss_mask`; the mean token entropy over policy tokens; the tokens
    forwarded (the cost ledger's). `dedupe=False` scores duplicate rows too; `agree` makes
    every process run as many forwards and output-layer calls (`CallAgreement`, for ZeRO-3)."""
    forwarded = forwarded_tokens(input_ids, attention_mask, loss_mask)
    with torch.no_grad(), compute():
        lp, ent = token_logprobs(
            model, input_ids, attention_mask, loss_mask, chunk_size, temperature,
            with_entropy=True, dedupe=dedupe, agree=agree,
        )  # fmt: skip
    return align(lp) * loss_mask, float(masked_mean(align(ent), loss_mask)), forwarded


def groups_of_rows(rows: GroupTensors, step: int, names: Sequence[str]) -> list[StoredGroup]:
    """The rows of `len(names)` groups of `G` (a stack: `[b*G, T]` and `[b*G]`, group after
    group, with their behaviour log-probs) as StoredGroups made at `step`, named by `names`,
    each trimmed to its own longest row."""
    G = len(rows.input_ids) // len(names)
    return [
        make_group(name, rows.take(slice(k * G, (k + 1) * G)), step) for k, name in enumerate(names)
    ]
