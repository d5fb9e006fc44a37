"""Data-parallel training: the torch.distributed plumbing the trainer calls (the process group,
collectives, the DDP-wrapped loss forward, the gradient reduction, the RNG states).

`hdr train` is one code path for any number of processes. Launched plainly it is world size 1
and no process group exists; under `torchrun --nproc-per-node N` it reads RANK, WORLD_SIZE
and LOCAL_RANK, joins a process group (gloo on CPUs, NCCL on GPUs, each rank on
`cuda:LOCAL_RANK`), and every collective below does real work.

One step across N ranks (the protocol docs/trainer.md writes down):

1. Prompts (`trainer/fresh.py`). Every rank draws the step's `b` prompts (`sample_prompts`, a
   pure function of seed and step). They are cut into `distributed.rollout_shards` contiguous
   shards; rank r rolls out shards r, r+N, ... each under torch's RNG seeded from (seed, step,
   round, shard) (round > 0: dynamic sampling's refills), so a shard samples the same tokens
   whichever rank runs it and however many ranks there are. With vLLM (per-request seeds) a
   rank rolls all its shards out together, one engine call per turn, every trajectory seeded
   from its shard's seed and its place in the shard. The trajectories are all-gathered: every
   rank holds the step's whole rollout, so dynamic sampling's filter and refills, rewards,
   metrics and the cost ledger are the single-process ones.
2. Behaviour log-probs and advantages: the fresh groups are dealt round-robin, each rank
   teacher-forces its share, and the StoredGroups are all-gathered in step order.
3. Replay selection runs on every rank, on identical inputs: the buffer is replicated (every
   rank ingests the same fresh groups in the same order), so the global headroom order, the
   drift gate `tau` and the budget `R` are exactly the single-process ones. The only
   distributed part is the scoring callable the selector is given: the candidates of each
   scan chunk are split round-robin across ranks, each rank teacher-forces its share, and the
   log-probs are all-gathered, so every rank refreshes headroom and gates with the same
   numbers. Any registered selector that is a deterministic function of (buffer, step,
   params, scores, python/numpy/torch RNG) is therefore distributed faithfully; the ranks'
   RNG states stay equal because rollouts use forked, per-shard RNGs and only rank 0
   evaluates (under a forked RNG too); the sampling selectors draw from their own
   (seed, step) generator. After every selection the ranks compare the admitted group ids
   (and the fresh groups a swap selector leaves out) and refuse, in one line, to go on if
   they differ, rather than train on different batches.
4. Update: fresh + admitted groups are dealt round-robin to the ranks (group j to rank
   j mod N). Each rank's loss is its rows' clipped token sum divided by the token count of
   the whole global batch, so the gradients, summed across ranks by DDP (a sum hook, not
   DDP's mean), are exactly the single-process token-mean gradient. Gradient clipping then
   sees the same global gradient on every rank. A rank dealt no group runs one row with
   weight 0 so it still joins the all-reduce.
5. Ingress, logs, evaluation, checkpoints: every rank ingests (replicated buffer); rank 0
   alone writes logs, evaluates and writes checkpoints, which hold the buffer once and every
   rank's RNG state.

Where it departs from single-process training: float summation order (scoring batches hold
different rows; gradients are summed across ranks), so results agree within float tolerance,
not bit for bit. The buffer is replicated rather than sharded: each rank holds all `C`
groups (CPU memory) and the fresh groups cross the network once per step; in exchange every
selector runs unchanged. With the vLLM backend a trajectory's seeds are independent of N
too, but vLLM's batched kernels are not bit-for-bit batch invariant, so its samples may
differ in the last bits with the batch a rank forms.

Every rank holds the whole model (DDP). Sharded training (FSDP, ZeRO) is not offered here:
generation and no-grad scoring call the model outside the wrapped module, which sharding
would make every rank gather at different times; train sharded models through the TRL
integration (docs/integrations.md), whose engines own placement and weight sync.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist
from torch import nn

from core.errors import UserError
from trainer.scoring import forward_logprobs

T = TypeVar("T")
R = TypeVar("R")


# --- the process group -----------------------------------------------------------------------


@dataclass
class Dist:
    """This process's place in the job. World size 1 (no process group) is the plain run."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False  # this module initialised the process group (and ends it)
    collective_s: float = 0.0  # seconds inside collectives, waiting for peers included

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes logs, checkpoints and evaluations."""
        return self.rank == 0

    def share(self, n: int) -> list[int]:
        """This rank's items of `n` dealt round-robin: rank, rank + world, ..."""
        return list(range(self.rank, n, self.world))

    @contextmanager
    def _timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.collective_s += time.perf_counter() - start

    def take_collective_time(self) -> float:
        """Seconds spent in collectives since the last call."""
        spent, self.collective_s = self.collective_s, 0.0
        return spent

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order (pickled; our own processes only)."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        with self._timed():
            torch_dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        with self._timed():
            torch_dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over ranks (float64; every rank passes the same keys)."""
        if self.world == 1:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        if torch_dist.get_backend() == "nccl":
            t = t.cuda()
        with self._timed():
            torch_dist.all_reduce(t)
        return dict(zip(keys, t.cpu().tolist(), strict=True))

    def split_map(self, items: Sequence[T], fn: Callable[[list[T]], list[R]]) -> list[R]:
        """`fn` over `items`, its work split round-robin across ranks; every rank gets the
        whole result in `items`' order. `fn` maps a list to a same-length list."""
        if self.world == 1:
            return fn(list(items))
        done_here = fn([items[i] for i in self.share(len(items))])
        out: list[Any] = [None] * len(items)
        for rank, part in enumerate(self.all_gather(done_here)):
            out[rank :: self.world] = part
        return out

    def agree(self, value: Any, what: str) -> None:
        """Refuse, on every rank and in one line, to go on unless every rank holds the same
        `value` (`what` says what it is and what to do)."""
        values = self.all_gather(value)
        if any(v != values[0] for v in values):
            raise UserError(f"the {self.world} processes disagree on {what}")

    def on_main(self, fn: Callable[[], T]) -> T:
        """Run `fn` on rank 0 only and hand its result to every rank; a UserError raised
        there is raised on every rank with the same line (so no rank waits for a dead one)."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except UserError as err:
                error = str(err)
        result, error = self.broadcast((result, error))
        if error is not None:
            raise UserError(error)
        return result  # type: ignore[return-value]


def launched_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun sets them; (0, 1, 0) for a plain run."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def init_distributed(config):
    """Join the job's process group (if launched by torchrun) and localise the config: each
    rank's model on `cuda:LOCAL_RANK` when the config asks for CUDA. Returns (Dist, config).
    Refuses, in one line, a shard count the world size does not divide."""
    rank, world, local_rank = launched_world()
    dcfg = config.distributed
    if world == 1:
        return Dist(), config
    if dcfg.rollout_shards % world:
        raise UserError(
            f"distributed.rollout_shards={dcfg.rollout_shards} cannot be split over {world}"
            f" processes; set it to a multiple of {world} (a step's results then do not depend"
            " on the number of processes)"
        )
    cuda = config.model.device.startswith("cuda")
    if cuda:
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
        update = {"model": config.model.model_copy(update={"device": device})}
        if config.generation.device.startswith("cuda"):
            update["generation"] = config.generation.model_copy(update={"device": device})
        config = config.model_copy(update=update)
    owns = not torch_dist.is_initialized()
    if owns:
        torch_dist.init_process_group(
            "nccl" if cuda else "gloo",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=dcfg.timeout_s),
        )
    return Dist(rank=rank, world=world, local_rank=local_rank, owns_group=owns), config


GLOO_DRAIN_S = 0.5


def shutdown(dist: Dist) -> None:
    """Leave the process group this module started (after every rank's last collective).

    On gloo, the pause before the group is destroyed works around a deadlock in torch: gloo's
    worker thread frees a finished collective's tensors after the caller has its result, and
    freeing a tensor that Python made (`all_gather_object`'s) needs the GIL; the group's
    destructor joins that thread while holding the GIL (in `destroy_process_group`, or later
    when DDP's reducer lets go of the group): a rank that never exits (docs/notebook/trainer.md,
    "why the group pauses before it leaves"). Sleeping releases the GIL, so the thread finishes
    first."""
    if dist.owns_group and torch_dist.is_initialized():
        torch_dist.barrier()
        if torch_dist.get_backend() == "gloo":
            time.sleep(GLOO_DRAIN_S)
        torch_dist.destroy_process_group()


# --- the trained module ------------------------------------------------------------------------


class TokenLogprobs(nn.Module):
    """The loss forward as a module (`trainer.scoring.forward_logprobs` of the policy), so
    DDP wraps exactly what the update calls: the policy's own `forward` is not used,
    the output layer runs only at policy tokens."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, target_mask, temperature: float = 1.0):
        return forward_logprobs(self.model, input_ids, attention_mask, target_mask, temperature)


def _sum_hook(process_group, bucket):
    """DDP comm hook: gradients add up across ranks (each rank's loss is already its share of
    the global token mean, so DDP's default average would divide by N once too often)."""
    group = process_group if process_group is not None else torch_dist.group.WORLD
    work = torch_dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_policy(model: nn.Module, dist: Dist) -> nn.Module:
    """The module the update runs: plain in one process, DDP across several."""
    policy = TokenLogprobs(model)
    if dist.world == 1:
        return policy
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [dist.local_rank] if next(model.parameters()).is_cuda else None
    # no buffer broadcast: ranks run different numbers of forwards per step (uneven rows),
    # and the policy's buffers (rotary tables) are constants; gradients as views into the
    # buckets: no second copy of every gradient (a 3B model's is 12 GB in fp32)
    ddp = DistributedDataParallel(
        policy, device_ids=device_ids, broadcast_buffers=False, gradient_as_bucket_view=True
    )
    ddp.register_comm_hook(None, _sum_hook)
    settle_buckets(ddp)
    return ddp


def settle_buckets(ddp: nn.Module) -> None:
    """Leave every gradient a zeroed view into DDP's final buckets, so that an update holds one
    copy of the gradients. The reducer's buckets hold the trainable parameters' bytes in their
    dtype for as long as the module lives (torch 2.13: one bucket of every parameter at
    construction, rebuilt at the forward after the first synced backward into buckets of at
    most `bucket_cap_mb`, 25 MiB, the first at most 1 MiB, in gradient-ready order). A pass
    whose gradients start as None accumulates its `no_sync` micro-batches into tensors of their
    own beside the buckets (a second copy until the last micro-batch's reduction copies them
    in), and gradients still viewing the first bucket at the rebuild would hold it beside the
    new ones. So: two synced forward/backward passes of a zero loss on one 2-token row, the
    gradients None before each: the first records the gradient order, the second's forward
    rebuilds the buckets with no gradient holding the old one, and its reduction makes every
    gradient a view into the new buckets. From then on `zero_gradients` zeroes them in place.
    Every rank runs it at setup (it reduces); no weight changes."""
    device = next(ddp.parameters()).device
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    real = torch.ones_like(ids)
    for _ in range(2):
        for param in ddp.parameters():
            param.grad = None
        logprobs, _ = ddp(ids, real, real)
        (logprobs.sum() * 0.0).backward()


def zero_gradients(optimizer: torch.optim.Optimizer, policy: nn.Module) -> None:
    """Clear the gradients between passes: in one process drop them (their memory is free
    until the next backward); under DDP zero them in place, since they are views into buckets
    that live as long as the module (`settle_buckets`): dropping them frees nothing and makes
    the next pass accumulate into a second copy."""
    optimizer.zero_grad(set_to_none=not hasattr(policy, "no_sync"))


def accumulate(policy: nn.Module, sync: bool):
    """Context for one micro-batch: gradients are reduced across ranks only when `sync`
    (the last micro-batch of a pass), accumulated locally before."""
    if sync or not hasattr(policy, "no_sync"):  # one process: nothing to hold back
        return nullcontext()
    return policy.no_sync()


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient's L2 norm (every rank holds the summed gradient); returns the
    norm before clipping."""
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))


# --- checkpoints -------------------------------------------------------------------------------


def gather_rng_states(dist: Dist) -> list[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    """Every rank's `capture_rng()`, on every rank. The tensors travel as numpy arrays: torch's
    pickling of a uint32 tensor (numpy's key state) does not load back."""
    from trainer.checkpoint import capture_rng

    tensors, info = capture_rng()
    states = dist.all_gather(({k: v.numpy() for k, v in tensors.items()}, info))
    return [({k: torch.from_numpy(v) for k, v in t.items()}, i) for t, i in states]


class SilentLogs:
    """What ranks other than 0 write: nothing (the RunLogs interface)."""

    def step(self, record: dict) -> None: ...

    def eval(self, record: dict) -> None: ...

    def groups_left(self, groups, step: int | None) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...
