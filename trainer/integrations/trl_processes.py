"""How TRL's processes share one replay step (`trainer/integrations/trl.py`): every process's
fresh groups gathered (`gather`), the replayed groups dealt so that every process trains as
many rows (`balanced_shares`, `keep_only`), ZeRO-3's per-call weight gathers paired across
processes (`zero3_call_agreement`), and TRL's per-token tensors cut per group
(`fresh_values`)."""

from __future__ import annotations

import torch

from core.errors import UserError
from headroom_drift import Selection, StoredGroup
from trainer.integrations.trl_layout import TRLRows


def balanced_shares(kept: list[int], selected: int) -> list[int]:
    """How many of the `selected` replayed groups each process trains beside its `kept` fresh
    groups, so that every process trains as many groups (rows) as every other: TRL's loss
    all-gathers per-row metrics (`clip_ratio/low_min`), which needs equal row counts (gloo
    fails with a size mismatch, NCCL may hang), and ZeRO-3's processes then also finish
    together. The emptiest processes are filled first; groups that would leave the counts
    uneven are not replayed this step (at most `len(kept) - 1`; they stay in the buffer)."""
    level, need = max(kept), sum(max(kept) - k for k in kept)
    if need > selected:  # not reachable by hdr's rules (swaps equal the groups swapped in)
        counts = [0] * len(kept)
        for _ in range(selected):
            p = min(range(len(kept)), key=lambda q: kept[q] + counts[q])
            counts[p] += 1
        return counts
    level += (selected - need) // len(kept)
    return [level - k for k in kept]


def keep_only(selection: Selection, n: int) -> None:
    """Cut `selection` (the lifecycle's pending one, whose groups ingress counts as replayed)
    to its first `n` admitted groups, in place."""
    for name in ("groups", "weights", "drift_admitted", "headroom_stored", "headroom_refreshed",
                 "scored"):  # fmt: skip
        values = getattr(selection, name)
        if len(values) > n:
            setattr(selection, name, values[:n])


class ReplayStepError(UserError):
    """A replay step that cannot train, decided from what every process shares, so that every
    process raises it alike (one line from `hdr trl-train`, none left waiting)."""

    exit_code = 1


def zero3_call_agreement(accelerator):
    """The `CallAgreement` across TRL's processes (None on one process): each process's
    output-layer calls per scoring chunk, maxed elementwise over processes, so that ZeRO-3's
    per-call weight gathers pair up whatever each process's rows hold (two all-reduces per
    scoring pass: the number of chunks, then the calls)."""
    if accelerator.num_processes == 1:
        return None

    def agree(calls: list[int]) -> list[int]:
        import torch.distributed as dist

        n = torch.tensor([len(calls)], device=accelerator.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        plan = torch.zeros(int(n), dtype=torch.long, device=accelerator.device)
        plan[: len(calls)] = torch.tensor(calls, dtype=torch.long)
        dist.all_reduce(plan, op=dist.ReduceOp.MAX)
        return [int(c) for c in plan.cpu()]

    return agree


def fresh_values(rows: TRLRows, fresh: list[StoredGroup], kept: list[int], key: str):
    """Each kept fresh group's slice `[G, T_g]` of one of TRL's per-token tensors (None when
    TRL's batch has no such tensor)."""
    values = rows.per_token.get(key)
    if values is None:
        return None
    G = len(fresh[0].input_ids)
    return [values[k * G : (k + 1) * G, -fresh[k].input_ids.shape[1] :] for k in kept]


def gather(groups: list[StoredGroup], world: int) -> list[StoredGroup]:
    """Every process's groups, in process order (the same list on every process)."""
    if world == 1:
        return list(groups)
    from accelerate.utils import gather_object

    return gather_object(groups)
