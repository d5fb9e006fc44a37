"""Asynchronous rollout: worker processes generate ahead of the trainer; a staleness rule
decides which late groups enter the update (docs/trainer.md, "Asynchronous rollout").

Processes. `async_rollout.workers` = n rollout workers, each a `torch.multiprocessing` spawn
child with its own copy of the policy, its own generator (hf, or a vLLM engine: "Engines"
below), its own tokenizer and its own retrieval client. Worker w rolls out shards w, w+n,
... of every step's `distributed.rollout_shards` contiguous shards (`split: shards`; whole
steps in turn with `split: steps`), each seeded from `trainer.fresh.shard_seed(seed, step, 0,
shard)` (hf: torch's RNG; vllm: each trajectory's own seed) by the same code the synchronous
loop rolls out with (`trainer.fresh.roll_shards`): a shard's tokens depend on the weights it
was sampled with, never on which process sampled it. To the loop the workers are a fresh
source (`trainer.fresh.FreshSource`): `collect(step)` gives the step's `FreshBatch` with each
group's lag.

Versions and weight publication. The weights after update u are version u (a run starts at
version `start - 1`: 0, or the resumed checkpoint's step). The trainer publishes each version
into one shared-memory copy of the state dict (`WeightBoard`) under a sequence counter (a
seqlock): the writer never waits for a reader, a reader copies and retries if the counter
moved meanwhile, so a worker killed mid-copy cannot block the trainer.

The bounded queue. A worker may start step s's rollout once version `s - 1 - max_lag` is
published, and takes the newest version there is. The trainer trains step s after update
`s - 1`, so every group is `lag = (s - 1) - v` updates late, `0 <= lag <= max_lag`, and at
most `max_lag + 1` steps are rolled out ahead of the update that uses them. `max_lag = 0`:
each rollout waits for the previous update and uses its weights: the synchronous loop, the
same tokens bit for bit (the test compares them), only run in another process.

The gate. The trainer teacher-forces every fresh group under its current weights (the loop's
behaviour pass). For a late group that pass measures its Policy Drift `D(g)` against the
sampler's log-probs, and the staleness rule (`GroupReplay.admit_late`, the rules of
`headroom_drift.staleness`) admits or rejects it. An admitted late group trains with the
sampler's log-probs as its behaviour log-probs (the clipped ratio then corrects for the policy
that really sampled it); a rejected one enters the replay buffer with them, where Headroom may
bring it back when its drift passes the replay gate. The late groups' teacher-forced
tokens are `cost_gate_tf_tokens` in the ledger (moved out of `cost_behaviour_tf_tokens`, which
counts the on-time groups).

Faults. A worker that dies (killed, out of memory) or fails (a retrieval outage past
`retrieval.outage_grace_s`) stops the run, in one line naming the last checkpoint, at the
first step that needs its rollout: every step before it trained and logged whole. Stopping
discards the rollouts in flight; a resumed run rolls those steps out again from the
checkpoint's weights (so a resumed asynchronous run's lags differ from an uninterrupted
one's, and no group is ever trained twice).

Engines. With `generation.backend: hf` a worker samples from its module, into which each
version is copied. With `vllm` each worker builds its own engine (in the worker's process, as
the backend requires) and keeps the module beside it as the copy the board writes into: each
new version goes from the module into the engine through the backend's checked sync
(`collective_rpc("reload_weights", ...)`, then the engine's log-probs of fixed tokens against
the module's teacher forcing, one line if they differ), and the worker rolls all its shards
out together, each trajectory under its own seed, as the synchronous loop does with vllm.
The trainer's own engine (held-out evaluation) is then built only when first used
(`trainer.fresh.LazyGenerator`), so a run holds `workers` engines while it trains.

Devices. `async_rollout.devices` maps each worker to a device (trainer/async_rollout/devices.py):
a worker on `cuda:N` sees that one GPU only, its engine (or hf module) runs there, a vllm
worker's module stays on the CPU, and vLLM engines that share a GPU start one at a time.
`hdr plan-memory` plans the same map, and the run refuses one that does not fit.

Departures: one process group only (no torchrun); no dynamic sampling (a refill would be a
rollout the queue did not plan).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp

from core.errors import UserError
from trainer.async_rollout.devices import place_worker, shared_vllm_gpus
from trainer.fresh import (
    FreshBatch,
    RolloutContext,
    RolloutSpend,
    deal_shards,
    join_shards,
    nothing_reached,
    roll_shards,
    sample_prompts,
)
from trainer.tools.memory_plan import check_worker_placement

if TYPE_CHECKING:
    from trainer.config import TrainConfig
    from trainer.run import Run

POLL_S = 0.01  # how often a waiting worker looks at the published version


class RolloutWorkerLost(UserError):
    """A rollout worker ended or failed before delivering a rollout the trainer needs."""


# --- weight publication -------------------------------------------------------------------


class WeightBoard:
    """One shared-memory copy of the policy's state dict and its version, for the workers.

    `publish(model, version)` (trainer) copies the weights in; `load_into(model, have)`
    (worker) copies them out when the version is newer than `have`. A sequence counter makes
    the pair a seqlock: odd while the trainer writes; a reader that saw it odd, or changed,
    copies again."""

    def __init__(self, model: torch.nn.Module, version: int, ctx) -> None:
        self.tensors = {
            k: v.detach().to("cpu", copy=True).share_memory_()
            for k, v in model.state_dict().items()
        }
        self.seq = ctx.Value("q", 0, lock=False)
        self._version = ctx.Value("q", version, lock=False)

    @property
    def version(self) -> int:
        return int(self._version.value)

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        self.seq.value += 1  # odd: writing
        for name, value in model.state_dict().items():
            self.tensors[name].copy_(value)
        self._version.value = version
        self.seq.value += 1  # even: done

    @torch.no_grad()
    def load_into(self, model: torch.nn.Module, have: int) -> int:
        """Copy the published weights into `model` unless it already holds them (`have`);
        returns the version it now holds."""
        while True:
            before = int(self.seq.value)
            version = self.version
            if before % 2 == 0 and version == have:
                return have
            if before % 2 == 0:
                model.load_state_dict(self.tensors)
                if int(self.seq.value) == before:
                    return version
            time.sleep(POLL_S)


def responsible(split: str, workers: int, start: int, step: int) -> set[int]:
    """The workers that roll out (part of) `step`: all of them, each its shards (`shards`), or
    one, steps dealt round-robin from the run's first step (`steps`)."""
    if split == "shards":
        return set(range(workers))
    return {(step - start) % workers}


# --- the worker process -------------------------------------------------------------------


@dataclass
class WorkerSpec:
    """What a worker needs to start: the run's config, its place, the steps it rolls out."""

    config: TrainConfig
    index: int
    start: int
    threads: int


@dataclass
class WorkerTiming:
    """Where a worker's time for one rollout went: waiting for the version the queue bound
    allows, copying the published weights in, the rollout itself (generation and search),
    and its process CPU seconds over all three (`cpu_s / wall` is its CPU utilisation)."""

    wait_version_s: float
    load_weights_s: float  # board -> the worker's module, and into its engine (vllm)
    rollout_s: float
    cpu_s: float
    engine_sync_gap: float | None = None  # vllm: the weight check's mean log-prob gap

    @property
    def wall_s(self) -> float:
        return self.wait_version_s + self.load_weights_s + self.rollout_s


STAT_SUMS = ("calls", "requests", "attempts", "retries", "failures", "queries", "passages",
             "billed_queries", "cached_queries", "failed_queries", "truncated_queries",
             "refused_queries", "bad_responses", "outages", "outage_s", "latency_s")  # fmt: skip


def stats_delta(before, after) -> dict[str, Any]:
    """The client's counters moved between two copies of its stats."""
    delta = {k: getattr(after, k) - getattr(before, k) for k in STAT_SUMS}
    delta["request_latencies"] = after.request_latencies[len(before.request_latencies) :]
    delta["max_in_flight"] = after.max_in_flight
    return delta


def worker_main(spec: WorkerSpec, board: WeightBoard, conn, stop) -> None:
    """A rollout worker: for each of its steps, wait for the version the queue bound allows,
    take the newest weights, roll out its shards, send them. Every failure is one message."""
    from dataclasses import replace

    # Ctrl-C or a scheduler's SIGTERM to the process group stops the trainer after its step,
    # and the trainer stops us; a trainer that dies leaves us its orphans: we leave too
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    torch.set_num_threads(spec.threads)
    step = spec.start
    try:
        from agent_env.data import load_questions
        from agent_env.generation import build_generator
        from agent_env.retrieval_client import connect
        from trainer.run import cache_scope, load_policy

        cfg = place_worker(spec.config, spec.index)
        a = cfg.async_rollout
        model, tokenizer = load_policy(cfg.model.path, cfg)
        model.requires_grad_(False)
        # hf samples from this module; a vLLM engine holds its own weights, which every new
        # version reaches through the backend's checked sync from this module
        engine = cfg.generation.backend != "hf"
        generator = build_generator(
            cfg.generation, model_dir=cfg.model.path, tokenizer=tokenizer,
            prompt=cfg.rollout.prompt, model=None if engine else model,
        )  # fmt: skip
        client = connect(
            cfg.retrieval, seed=cfg.seed + 1 + spec.index, cache_scope=cache_scope(cfg)
        )
        train_examples, _ = load_questions(cfg.data, cfg.seed, cfg.eval.num_questions)
        context = RolloutContext(cfg, generator, client, tokenizer)
        shards = range(cfg.distributed.rollout_shards)
        if a.split == "shards":
            shards = range(spec.index, cfg.distributed.rollout_shards, a.workers)
        conn.send(("ready", spec.index, os.getpid()))
        have = -1
        for step in range(spec.start, cfg.steps + 1):
            if spec.index not in responsible(a.split, a.workers, spec.start, step):
                continue
            began, cpu_began = time.perf_counter(), time.process_time()
            while board.version < step - 1 - a.max_lag:
                if stop.is_set() or os.getppid() != parent:
                    return
                time.sleep(POLL_S)
            waited = time.perf_counter()
            had, have = have, board.load_into(model, have)
            if engine and have != had:
                generator.sync_weights(model)  # checked: one line if the engine lags behind
            loaded = time.perf_counter()
            examples = sample_prompts(train_examples, cfg.seed, step, cfg.grpo.batch_prompts)
            mine = deal_shards(examples, cfg.distributed.rollout_shards, shards)
            before = replace(client.stats, request_latencies=list(client.stats.request_latencies))
            pieces, spent = roll_shards(context, mine, step, 0)
            timing = WorkerTiming(
                wait_version_s=waited - began,
                load_weights_s=loaded - waited,
                rollout_s=time.perf_counter() - loaded,
                cpu_s=time.process_time() - cpu_began,
                engine_sync_gap=getattr(generator, "last_sync_gap", None),
            )
            conn.send(("rollout", spec.index, step, have, pieces, spent,
                       stats_delta(before, client.stats), timing))  # fmt: skip
            if stop.is_set():
                return
    except BaseException as err:
        from agent_env.retrieval_client import RetrievalUnavailable

        kind = "retrieval" if isinstance(err, RetrievalUnavailable) else "error"
        line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if kind == "error" and not isinstance(err, UserError):
            line = f"{type(err).__name__}: {line} ({traceback.format_exc(limit=-1).strip()})"
        with contextlib.suppress(OSError):
            conn.send(("error", spec.index, step, kind, line))
    finally:
        conn.close()


# --- the trainer's side -------------------------------------------------------------------


@dataclass
class Delivered:
    """One worker's rollout of its shards of one step."""

    version: int
    pieces: list  # [(shard, kept groups, dropped groups)]
    spent: RolloutSpend
    stats: dict[str, Any]
    timing: WorkerTiming


@dataclass
class RolloutWorkers:
    """The trainer's handle on its rollout workers, a `trainer.fresh.FreshSource`:
    `collect(step)` the step's rollout, `publish(model, version)` after each update, `close()`
    at the end."""

    config: TrainConfig
    board: WeightBoard
    processes: list
    stop: Any
    client_stats: Any  # the trainer's retrieval counters (`ClientStats`), which the workers' join
    first_step: int  # the first step of this process's run
    inbox: queue.Queue = field(default_factory=queue.Queue)
    arrived: dict[int, dict[int, Delivered]] = field(default_factory=dict)
    failed: dict[int, tuple[int, str, str]] = field(default_factory=dict)  # w -> (step, kind, line)
    ended: set[int] = field(default_factory=set)
    pids: dict[int, int] = field(default_factory=dict)
    readers: list[threading.Thread] = field(default_factory=list)
    spawned_at: dict[int, float] = field(default_factory=dict)  # monotonic seconds
    ready_at: dict[int, float] = field(default_factory=dict)

    @classmethod
    def start(cls, run: Run, start: int) -> RolloutWorkers:
        """Spawn the workers with the run's current weights as version `start - 1` and wait
        until every one has loaded (a worker's setup failure is one line here)."""
        cfg = run.config
        check_worker_placement(cfg)
        one_at_a_time = shared_vllm_gpus(cfg)
        ctx = mp.get_context("spawn")
        board = WeightBoard(run.model, start - 1, ctx)
        stop = ctx.Event()
        workers = cls(cfg, board, [], stop, run.client.stats, start)
        try:  # a failed start stops the workers already spawned (they would outlive us)
            for w in range(cfg.async_rollout.workers):
                if one_at_a_time:
                    workers._wait_ready(cfg.async_rollout.start_timeout_s)
                workers._spawn(ctx, w, start)
            workers._wait_ready(cfg.async_rollout.start_timeout_s)
        except BaseException:
            workers.close()
            raise
        return workers

    def _spawn(self, ctx, w: int, start: int) -> None:
        """Start worker `w` and the thread that reads what it sends."""
        self.spawned_at[w] = time.monotonic()
        receive, send = ctx.Pipe(duplex=False)
        threads = self.config.async_rollout.worker_threads or torch.get_num_threads()
        spec = WorkerSpec(self.config, w, start, threads)
        proc = ctx.Process(
            target=worker_main, args=(spec, self.board, send, self.stop), name=f"hdr-rollout-{w}"
        )
        proc.start()
        send.close()  # the child holds the only writer: its death is EOF here
        self.processes.append(proc)
        reader = threading.Thread(target=_read, args=(w, receive, self.inbox), daemon=True)
        reader.start()
        self.readers.append(reader)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.pids) < len(self.processes):
            for w, (_, _, line) in self.failed.items():
                raise UserError(f"rollout worker {w} could not start: {line}")
            for w in self.ended:
                raise UserError(f"rollout worker {w} ended while starting ({self._exit(w)})")
            if time.monotonic() > deadline:
                raise UserError(
                    f"rollout workers not ready after {timeout_s:.0f} s"
                    " (async_rollout.start_timeout_s)"
                )
            self._take(timeout=0.5)

    def _take(self, timeout: float) -> None:
        try:
            message = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return
        kind, w = message[0], message[1]
        if kind == "ready":
            self.pids[w] = message[2]
            self.ready_at[w] = time.monotonic()
        elif kind == "rollout":
            _, _, step, version, pieces, spent, stats, timing = message
            self.arrived.setdefault(step, {})[w] = Delivered(version, pieces, spent, stats, timing)
        elif kind == "error":
            self.failed[w] = (message[2], message[3], message[4])
        elif kind == "eof":
            self.ended.add(w)

    def _exit(self, w: int) -> str:
        proc = self.processes[w]
        proc.join(timeout=5)
        code = proc.exitcode
        if code is not None and code < 0:
            return f"pid {proc.pid}, killed by {signal.Signals(-code).name}"
        return f"pid {proc.pid}, exit code {code}"

    def collect(self, step: int) -> FreshBatch:
        """Step `step`'s rollout from every worker: the groups in shard order with each kept
        group's lag (`step - 1 - version`); the workers' client counters join the trainer's.
        Raises RetrievalUnavailable or RolloutWorkerLost when a worker cannot deliver it."""
        parts = self._wait_for(step)
        result = join_shards([(d.pieces, d.spent) for d in parts.values()])
        version = {shard: d.version for d in parts.values() for shard, _, _ in d.pieces}
        kept = {shard: len(groups) for d in parts.values() for shard, groups, _ in d.pieces}
        lags = [step - 1 - version[s] for s in sorted(version) for _ in range(kept[s])]
        stats: dict[str, Any] = {k: sum(d.stats[k] for d in parts.values()) for k in STAT_SUMS}
        stats["request_latencies"] = [
            x for d in parts.values() for x in d.stats["request_latencies"]
        ]
        stats["max_in_flight"] = max(d.stats["max_in_flight"] for d in parts.values())
        add_stats(self.client_stats, stats)
        if not result.groups:
            raise nothing_reached(step, self.config.retrieval.urls)
        timing = [parts[w].timing for w in sorted(parts)]
        return FreshBatch(
            result.groups, [result], int(stats["passages"]), lags, timing,
            billed_searches=int(stats["billed_queries"]),
            cached_searches=int(stats["cached_queries"]),
        )  # fmt: skip

    def _wait_for(self, step: int) -> dict[int, Delivered]:
        """Every responsible worker's delivery of `step`, by worker; raises when one of them
        failed or ended before delivering it."""
        from agent_env.retrieval_client import RetrievalUnavailable

        a = self.config.async_rollout
        needed = responsible(a.split, a.workers, self.first_step, step)
        while not needed <= set(self.arrived.get(step, {})):
            missing = needed - set(self.arrived.get(step, {}))
            for w in sorted(missing):
                if w in self.failed:
                    failed_step, kind, line = self.failed[w]
                    if kind == "retrieval":
                        raise RetrievalUnavailable(line)
                    raise RolloutWorkerLost(
                        f"rollout worker {w} failed in step {failed_step}'s rollout: {line}"
                    )
                if w in self.ended:
                    raise RolloutWorkerLost(
                        f"rollout worker {w} ended before delivering step {step}'s rollout"
                        f" ({self._exit(w)})"
                    )
            self._take(timeout=0.5)
        return self.arrived.pop(step)

    def publish(self, model: torch.nn.Module, version: int) -> None:
        self.board.publish(model, version)

    def close(self) -> int:
        """Stop every worker (a rollout in flight is discarded); returns how many steps'
        rollouts had arrived unused."""
        self.stop.set()
        for proc in self.processes:
            proc.join(timeout=2)
        for proc in self.processes:  # one still in a rollout: its work is discarded anyway
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=30)
        while not self.inbox.empty():
            self._take(timeout=0)
        unused = len(self.arrived)
        self.arrived.clear()
        return unused


def _read(w: int, conn, inbox: queue.Queue) -> None:
    """Move worker `w`'s messages into the inbox as they come (so a worker never waits on
    the trainer to send), then ("eof", w) once its end of the pipe is gone."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(("eof", w))
    finally:
        conn.close()


def add_stats(client_stats, delta: dict[str, Any]) -> None:
    """Count the workers' retrieval in the trainer's client counters (the step's record reads
    its retrieval figures there)."""
    for k in STAT_SUMS:
        setattr(client_stats, k, getattr(client_stats, k) + delta[k])
    client_stats.request_latencies.extend(delta["request_latencies"])
    client_stats.max_in_flight = max(client_stats.max_in_flight, delta["max_in_flight"])
