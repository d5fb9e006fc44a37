"""Fresh rollouts: where every step's new groups come from (steps 1-2 of docs/design.md).

What the synchronous loop and the rollout workers (`trainer/async_rollout/workers.py`) both
do, once:

- Prompts. `sample_prompts`: the step's `b` prompts, epochs of seeded permutations, a pure
  function of (seed, step), so a resumed run draws what the original would. Dynamic sampling
  (`grpo.dynamic_sampling`, DAPO-style) drops groups whose rewards are all equal
  (`has_reward_variance`) and refills the batch from `refill_prompts`, a stream of its own.
- Shards. The step's prompts are cut into `distributed.rollout_shards` contiguous shards
  (`deal_shards`), each rolled out under its own seed (`shard_seed`, from seed, step, round and
  shard): a backend that samples from torch's RNG (hf) rolls the shards out one by one, each
  under torch's RNG seeded so; one that seeds each request (vllm) rolls them out together,
  one engine call per turn, every trajectory with the seed of its place in its shard
  (`trajectory_seeds`). Either way a shard's tokens depend on the weights and the seeds only,
  never on the process that rolls it out (`roll_shards`). The shards of several processes
  (or workers) are joined back in shard order with their spend (`join_shards`).
- The fresh batch. `fresh_batch` rolls out a step's prompts across the processes of a
  torchrun job (`rollout_sharded`: each process its shards, every process all the groups),
  applies dynamic sampling, and returns a `FreshBatch`: the kept groups and every rollout
  made to get them (the cost ledger counts them all).
- Sources. The loop takes each step's batch from a `FreshSource`: `InProcessRollout` (the
  trainer's own processes, after the previous update) or `RolloutWorkers` (worker processes
  that run ahead, `trainer/async_rollout/workers.py`), and publishes each update's weights to it.

A rollout reads a `RolloutContext`: the run's config, the generator, the retrieval client,
the tokenizer and the process's place in the job. `LazyGenerator` is the trainer's generator
when the rollout workers hold the engines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from core.errors import UserError
from trainer.distributed import Dist

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agent_env.data import QAExample
    from agent_env.generation.base import Generator
    from agent_env.retrieval_client import RetrievalClient
    from agent_env.rollout import RolloutResult, Trajectory
    from trainer.config import TrainConfig

    Group = list[Trajectory]  # one prompt's G responses
    Piece = tuple[int, list[Group], list[Group]]  # (shard, kept groups, dropped groups)


@dataclass
class RolloutContext:
    """What a rollout reads. The trainer's run holds one (`Run.rollout_context`), each rollout
    worker builds its own (one process: `dist` of world size 1)."""

    config: TrainConfig
    generator: Generator
    client: RetrievalClient
    tokenizer: PreTrainedTokenizerBase
    dist: Dist = field(default_factory=Dist)


# --- prompts -------------------------------------------------------------------------------


def sample_prompts(examples: list[QAExample], seed: int, step: int, b: int) -> list[QAExample]:
    """The `b` prompts of `step` (1-based): epochs of seeded permutations, read in order.
    A pure function of (seed, step), so a resumed run draws what the original would."""
    n = len(examples)
    out = []
    for j in range((step - 1) * b, step * b):
        epoch, pos = divmod(j, n)
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        out.append(examples[int(perm[pos])])
    return out


def refill_prompts(
    examples: list[QAExample], seed: int, step: int, round_: int, n: int
) -> list[QAExample]:
    """`n` extra prompts for dynamic sampling's refill `round_` of `step`: distinct, drawn from
    a stream of their own, a pure function of (seed, step, round)."""
    rng = np.random.default_rng([seed, step, round_, 7_919])
    picks = rng.choice(len(examples), size=min(n, len(examples)), replace=False)
    return [examples[int(i)] for i in picks]


def has_reward_variance(group: Group) -> bool:
    """Whether a group's rewards differ (else every advantage is 0: no gradient)."""
    return len({t.reward for t in group}) > 1


# --- shards --------------------------------------------------------------------------------


def shard_bounds(num_prompts: int, shards: int) -> list[range]:
    """Contiguous, near-equal shards of the step's prompt positions."""
    return [
        range(s * num_prompts // shards, (s + 1) * num_prompts // shards) for s in range(shards)
    ]


def deal_shards(
    examples: list[QAExample], shards: int, taken: Iterable[int]
) -> list[tuple[int, list[QAExample]]]:
    """`(shard, its examples)` for each shard in `taken` that holds any, of `examples` cut
    into `shards` contiguous shards."""
    bounds = shard_bounds(len(examples), shards)
    return [(s, [examples[i] for i in bounds[s]]) for s in taken if bounds[s]]


def shard_seed(seed: int, step: int, round_: int, shard: int) -> int:
    """torch's seed for one rollout shard (of the step's batch, round 0, or of a dynamic-
    sampling refill): a function of (seed, step, round, shard) only."""
    return int(np.random.SeedSequence([seed, step, round_, shard]).generate_state(1, np.uint64)[0])


def trajectory_seeds(shard_seed_: int, count: int) -> list[int]:
    """The sampling seeds of one shard's `count` trajectories (example-major), for a backend
    that seeds each request (vllm): a function of the shard's seed and the position only."""
    state = np.random.SeedSequence(shard_seed_).generate_state(count, np.uint32)
    return [int(x) for x in state]


@dataclass
class RolloutSpend:
    """One process's rollout totals: batched requests, searching turns and times."""

    env_calls: int = 0
    retrieval_calls: int = 0
    gen_time: float = 0.0
    retrieval_time: float = 0.0
    wall_time: float = 0.0

    def add(self, result: RolloutResult) -> None:
        self.env_calls += result.env_calls
        self.retrieval_calls += result.retrieval_calls
        self.gen_time += result.gen_time
        self.retrieval_time += result.retrieval_time
        self.wall_time += result.wall_time


def roll_shards(
    ctx: RolloutContext, shards: list[tuple[int, list[QAExample]]], step: int, round_: int
) -> tuple[list[Piece], RolloutSpend]:
    """This process's shards of a step's rollout (round 0) or of a refill: one by one under
    torch's RNG seeded by `shard_seed` (hf), or together with a seed per trajectory (a backend
    with `per_request_seeds`). Returns `[(shard, kept groups, dropped groups)]` and the
    spend; the shared RNG is left as it was."""
    together = ctx.generator.per_request_seeds
    return (_roll_together if together else _roll_one_by_one)(ctx, shards, step, round_)


def _roll_one_by_one(ctx: RolloutContext, shards, step: int, round_: int):
    from agent_env.rollout import rollout_groups

    cfg, spent, pieces = ctx.config, RolloutSpend(), []
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    for shard, examples in shards:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(shard_seed(cfg.seed, step, round_, shard))
            G = cfg.grpo.group_size
            result = rollout_groups(
                ctx.generator, ctx.client, ctx.tokenizer, examples, G, cfg.rollout
            )
        spent.add(result)
        pieces.append((shard, result.groups, result.dropped))
    return pieces, spent


def _roll_together(ctx: RolloutContext, shards, step: int, round_: int):
    """All the shards in one rollout (one engine call per turn), every trajectory with its own
    seed; the groups are split back into shards, and a failed group dropped from its own
    shard's as `rollout.on_failure` says."""
    from agent_env.rollout import rollout_groups, split_failed

    cfg, G, spent = ctx.config, ctx.config.grpo.group_size, RolloutSpend()
    if not shards:
        return [], spent
    examples = [ex for _, part in shards for ex in part]
    seeds = [
        seed
        for shard, part in shards
        for seed in trajectory_seeds(shard_seed(cfg.seed, step, round_, shard), len(part) * G)
    ]
    config = cfg.rollout
    if config.on_failure == "drop_group":  # dropped per shard below, after the split
        config = config.model_copy(update={"on_failure": "keep"})
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):  # nothing here moves the shared RNG
        result = rollout_groups(
            ctx.generator, ctx.client, ctx.tokenizer, examples, G, config, seeds=seeds
        )
    spent.add(result)
    pieces, start = [], 0
    for shard, part in shards:
        groups = result.groups[start : start + len(part)]
        start += len(part)
        kept, dropped = groups, []
        if cfg.rollout.on_failure == "drop_group":
            kept, dropped = split_failed(groups)
        pieces.append((shard, kept, dropped))
    return pieces, spent


def join_shards(parts: Sequence[tuple[Sequence[Piece], RolloutSpend]]) -> RolloutResult:
    """One RolloutResult from the shards several processes (or workers) rolled out, each part
    its pieces and its spend: the groups in shard order, the counts summed, the times the
    slowest part's."""
    from agent_env.rollout import RolloutResult

    ordered = sorted((piece for pieces, _ in parts for piece in pieces), key=lambda p: p[0])
    spends = [spend for _, spend in parts]
    return RolloutResult(
        groups=[g for _, kept, _ in ordered for g in kept],
        env_calls=sum(s.env_calls for s in spends),
        retrieval_calls=sum(s.retrieval_calls for s in spends),
        gen_time=max(s.gen_time for s in spends),
        retrieval_time=max(s.retrieval_time for s in spends),
        wall_time=max(s.wall_time for s in spends),
        dropped=[g for _, _, dropped in ordered for g in dropped],
    )


def rollout_sharded(
    ctx: RolloutContext, examples: list[QAExample], step: int, round_: int = 0
) -> RolloutResult:
    """Roll out `examples` (`G` responses each) as `distributed.rollout_shards` shards: this
    process rolls out shards rank, rank + N, ... and every process receives every shard's
    groups (`join_shards`)."""
    shards = ctx.config.distributed.rollout_shards
    mine = deal_shards(examples, shards, ctx.dist.share(shards))
    return join_shards(ctx.dist.all_gather(roll_shards(ctx, mine, step, round_)))


# --- the fresh batch -----------------------------------------------------------------------


@dataclass
class FreshBatch:
    """The step's fresh groups for the update, and every rollout made to get them."""

    groups: list[Group]  # kept groups (b, or fewer after dynamic sampling's filter)
    rollouts: list[RolloutResult]  # the step's batch and each refill
    passages: int  # documents the environment returned over all of them
    lags: list[int] | None = None  # per group, updates late (rollout workers); None: on time
    timing: list | None = None  # each delivering worker's WorkerTiming (rollout workers)
    # of the searches answered, those the retrieval server computed for them (searched, or
    # forwarded to a paid upstream: what a backend bills) and those it answered from its
    # cache or an identical search in flight (its X-HDR-* headers; every search is billed by
    # a server without them)
    billed_searches: int = 0
    cached_searches: int = 0

    @property
    def trajectories(self) -> list[Trajectory]:
        """The trajectories rolled out this step (refills included, dropped groups not)."""
        return [t for r in self.rollouts for g in r.groups for t in g]

    @property
    def spent(self) -> list[Trajectory]:
        """Every trajectory that cost a rollout: refills and dropped groups included."""
        return [t for r in self.rollouts for g in [*r.groups, *r.dropped] for t in g]


def nothing_reached(step: int, urls: Sequence[str]) -> UserError:
    """The error of a step none of whose rollouts reached the retrieval server."""
    return UserError(
        f"step {step}: every rollout failed to reach the retrieval server"
        f" ({', '.join(urls)}); is it running? (hdr serve --index DIR)"
    )


LEDGER_STATS = ("passages", "billed_queries", "cached_queries")  # ClientStats counters summed


def fresh_batch(ctx: RolloutContext, examples: list[QAExample], step: int) -> FreshBatch:
    """Roll out the step's `b` prompts. With `grpo.dynamic_sampling` (DAPO-style), groups
    whose rewards are all equal are dropped and refilled with extra prompts, up to
    `refill_rounds` times; the kept groups are capped at `b`. Across processes each rolls
    out its shards of every batch and all of them receive every group, so what follows is
    the same on every process."""
    cfg = ctx.config
    b = cfg.grpo.batch_prompts
    before = replace(ctx.client.stats)
    rollouts = [rollout_sharded(ctx, sample_prompts(examples, cfg.seed, step, b), step, 0)]
    kept = rollouts[0].groups
    if cfg.grpo.dynamic_sampling:
        kept = [g for g in kept if has_reward_variance(g)]
        for round_ in range(1, cfg.grpo.refill_rounds + 1):
            if len(kept) >= b:
                break
            extra = refill_prompts(examples, cfg.seed, step, round_, b - len(kept))
            rollouts.append(rollout_sharded(ctx, extra, step, round_))
            kept += [g for g in rollouts[-1].groups if has_reward_variance(g)]
        kept = kept[:b]
    if not any(r.groups for r in rollouts):
        raise nothing_reached(step, cfg.retrieval.urls)
    after = ctx.client.stats
    counts = ctx.dist.sum(
        {key: getattr(after, key) - getattr(before, key) for key in LEDGER_STATS}
    )  # every process's searches
    return FreshBatch(
        kept, rollouts, int(counts["passages"]),
        billed_searches=int(counts["billed_queries"]),
        cached_searches=int(counts["cached_queries"]),
    )  # fmt: skip


# --- where the loop takes them from ----------------------------------------------------------


class FreshSource(Protocol):
    """Where the loop takes each step's fresh groups from, and gives each update's weights to."""

    def collect(self, step: int) -> FreshBatch:
        """Step `step`'s fresh batch (raises a UserError when none of it could be made)."""
        ...

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """The weights after update `version`, for the rollouts still to come."""
        ...

    def close(self) -> None:
        """Stop; rollouts in flight are discarded."""
        ...


@dataclass
class InProcessRollout:
    """The synchronous loop's source: the trainer's processes roll each step out themselves,
    with the weights of the update just made."""

    context: RolloutContext
    examples: list[QAExample]

    def collect(self, step: int) -> FreshBatch:
        return fresh_batch(self.context, self.examples, step)

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Nothing to do: the rollout samples from the trainer's own weights (the generator's
        weight sync is the loop's)."""

    def close(self) -> None:
        """Nothing runs between steps."""


class LazyGenerator:
    """The trainer's generator when rollout workers hold the engines (`vllm` with
    `async_rollout.workers`): built at its first `generate` (the held-out evaluation), with
    the trainer's weights at that moment; until then `sleep` and `sync_weights` have nothing
    to do. `build()` returns the real generator."""

    def __init__(
        self, build: Callable[[], Generator], model: torch.nn.Module, per_request_seeds: bool
    ) -> None:
        self.build = build
        self.model = model
        self.per_request_seeds = per_request_seeds
        self.inner: Generator | None = None

    def generate(self, contexts, params, seeds=None):
        if self.inner is None:
            self.inner = self.build()
            self.inner.sync_weights(self.model)
        return self.inner.generate(contexts, params, seeds=seeds)

    def sleep(self) -> None:
        if self.inner is not None:
            self.inner.sleep()

    def sync_weights(self, model) -> None:
        if self.inner is not None:
            self.inner.sync_weights(model)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
