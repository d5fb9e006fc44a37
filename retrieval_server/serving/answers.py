"""A request's answers, each paid for once: from the cache, from a computation in flight, or
computed by the backend (the local batcher, or an upstream server behind `--upstream`).

`Answers.get(queries, topk, retriever, return_scores)` returns each query's answer as the
encoded JSON list that goes into the response (`render_query`), and how many of the queries
were billed (computed by this request) and how many were not (a cache hit, another request's
computation in flight, or a duplicate inside this request). For every distinct key of a
request that is neither cached nor in flight, the request becomes its leader: it registers a
future for the key, computes all its led keys in one backend call, stores them in the cache
and resolves the futures; a request that finds a key in flight waits on that future instead
(coalescing), so N concurrent identical queries make one computation, and a micro-batch never
holds the same key twice. A leader that stops (its client left, its deadline passed) hands
its keys back: their waiters look them up again and one of them leads. A leader's error is
not passed on to its waiters: it may be the leader's own (its size filled the queue, it
needed more of the spend budget than is left, the upstream refused its request), so each
waiter looks its keys up again and leads them itself: at worst one call for its own keys, as
without coalescing.

A backend that bills what it was sent (the upstream of proxy mode: `finishes_abandoned`) has
its computations run to the end even when every request waiting for them has left: the leader
computes in a task of its own and waits on it, so a client that disconnects cannot leave a paid
call unbilled, and its answer is cached and given to the waiters instead of being paid for a
second time. The local index's searches stop with their last client instead (its queue drops
them).

With a shared cache (`retrieval_server.fleet`, `cache.backend: redis`), a leader looks its
keys up there before computing, takes the fleet's lock of the ones it computes and writes
their answers back; a key another replica holds the lock of is waited for, and taken over if
that lock goes without an answer. Redis unreachable: the leader computes, as without it.

A backend may answer some queries without computing them (a served snapshot reads them): it
returns `Computed(answers, paid)`, and only `paid` are billed; the rest count as hits.

With the cache disabled every query goes to the backend as it came (no lookup, no
coalescing): every query billed, as before the cache existed.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from retrieval_server.serving.batching import MicroBatcher, Passage
from retrieval_server.serving.cache import CacheKey, ResultCache
from retrieval_server.serving.emulated_cost import CostEmulator

if TYPE_CHECKING:
    from retrieval_server.fleet.cache import SharedCache


class Backend(Protocol):
    """What computes answers for the queries the cache cannot answer."""

    async def compute(
        self, queries: list[str], topk: int, retriever: str, return_scores: bool
    ) -> list[bytes]:
        """Each query's answer as an encoded JSON list (see `render_query`), in order."""
        ...


def score_json(score: float) -> bytes:
    return repr(score).encode() if math.isfinite(score) else b"null"


def render_query(passages: Sequence[Passage], with_scores: bool) -> bytes:
    """One query's answer from pre-encoded documents, without parsing them again: a list of
    `{"document": ..., "score": ...}` with scores, of the documents alone without."""
    if with_scores:
        items = b",".join(
            b'{"document":%s,"score":%s}' % (document, score_json(score))
            for document, score in passages
        )
    else:
        items = b",".join(document for document, _ in passages)
    return b"[" + items + b"]"


def join_answers(answers: Sequence[bytes]) -> bytes:
    """The response body `{"result": [answer, ...]}` from encoded answers."""
    return b'{"result":[' + b",".join(answers) + b"]}"


class BatcherBackend:
    """The local index: queries searched through the micro-batcher (passages read in its
    search thread) and rendered."""

    finishes_abandoned = False  # a search nobody waits for leaves the queue

    def __init__(self, batcher: MicroBatcher) -> None:
        self.batcher = batcher

    async def compute(
        self, queries: list[str], topk: int, retriever: str, return_scores: bool
    ) -> list[bytes]:
        passages = await self.batcher.search(queries, topk, retriever)
        return [render_query(query, return_scores) for query in passages]


class Computed(list):
    """A backend's answers of which only `paid` were computed (billed): a snapshot's others
    were read, as a cache's are. A plain list is all paid for."""

    def __init__(self, answers: list[bytes], paid: int) -> None:
        super().__init__(answers)
        self.paid = paid


def paid_for(answers: list[bytes]) -> int:
    """How many of a backend's answers were computed for them (billed)."""
    return answers.paid if isinstance(answers, Computed) else len(answers)


class LedAnswers(dict):
    """A leader's computed answers by key, and how many of them were paid for."""

    paid: int = 0


@dataclass
class Answered:
    """A request's answers in order, and how many of its queries were computed for it."""

    answers: list[bytes]
    billed: int

    @property
    def cached(self) -> int:
        return len(self.answers) - self.billed


Led = tuple[dict[CacheKey, bytes], int, int]  # a leader's answers, computed here, shared hits


class LeaderGone(Exception):
    """The request computing a key stopped before it had the answer; look the key up again."""


class Answers:
    """The cache, the computations in flight and the backend, as one `get`."""

    def __init__(
        self,
        backend: Backend,
        cache: ResultCache | None,
        emulator: CostEmulator | None = None,
        shared: SharedCache | None = None,
    ) -> None:
        self.backend = backend
        self.cache = cache
        self.emulator = emulator
        self.shared = shared if cache is not None else None
        self.in_flight: dict[CacheKey, asyncio.Future[bytes]] = {}
        # computations that outlive their requests (`finishes_abandoned`), awaited at close
        self.detached: set[asyncio.Task[Led]] = set()

    async def get(
        self,
        queries: list[str],
        topk: int,
        retriever: str,
        return_scores: bool,
        scope: str = "",
    ) -> Answered:
        if self.cache is None:
            answers = await self._compute(list(queries), topk, retriever, return_scores)
            return Answered(answers, billed=paid_for(answers))
        keys = [CacheKey(scope, retriever, topk, return_scores, query) for query in queries]
        found: dict[CacheKey, bytes] = {}
        billed = hits = 0
        unresolved = list(dict.fromkeys(keys))  # distinct keys, in order
        while unresolved:
            led, waits, cached = self._claim(unresolved, found)
            hits += cached
            unresolved = []
            if led:
                answers, computed, from_fleet = await self._lead_to_the_end(led)
                found.update(answers)
                billed += computed
                hits += from_fleet
            for key, future in waits.items():
                try:
                    found[key] = await asyncio.shield(future)  # never cancel another's work
                except Exception:  # the leader's failure, perhaps its own: try it ourselves
                    unresolved.append(key)
        self.cache.stats.hits += hits
        # the rest was not computed for this request: in flight elsewhere, or a duplicate
        self.cache.stats.coalesced += len(keys) - billed - hits
        return Answered([found[key] for key in keys], billed)

    def _claim(
        self, keys: list[CacheKey], found: dict[CacheKey, bytes]
    ) -> tuple[list[CacheKey], dict[CacheKey, asyncio.Future[bytes]], int]:
        """Split `keys`: answered from the cache (into `found`; their count returned), in
        flight elsewhere (their futures), and led by this request (futures registered now)."""
        assert self.cache is not None
        led: list[CacheKey] = []
        waits: dict[CacheKey, asyncio.Future[bytes]] = {}
        loop = asyncio.get_running_loop()
        hits = 0
        for key in keys:
            cached = self.cache.get(key)
            if cached is not None:
                found[key] = cached
                hits += 1
            elif key in self.in_flight:
                waits[key] = self.in_flight[key]
            else:
                led.append(key)
                self.in_flight[key] = loop.create_future()
        return led, waits, hits

    async def _lead_to_the_end(self, keys: list[CacheKey]) -> Led:
        """`_lead`, in a task of its own for a backend that bills what it was sent: the
        request may stop waiting (its client left), the computation goes on."""
        if not getattr(self.backend, "finishes_abandoned", False):
            return await self._lead(keys)
        task = asyncio.get_running_loop().create_task(self._lead(keys))
        self.detached.add(task)
        task.add_done_callback(self._detached_done)
        return await asyncio.shield(task)

    def _detached_done(self, task: asyncio.Task) -> None:
        self.detached.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the request that awaited it may have left

    async def drain(self, timeout_s: float) -> None:
        """Let the computations that outlive their requests finish (at shutdown), then
        cancel what is left (a cancelled forward is billed if it was sent)."""
        if self.detached:
            await asyncio.wait(set(self.detached), timeout=timeout_s)
        for task in list(self.detached):
            task.cancel()
        if self.detached:
            await asyncio.wait(set(self.detached))

    async def _lead(self, keys: list[CacheKey]) -> Led:
        """Answer the keys this request leads: from the shared cache, from another
        replica's computation, or computed here; store and publish each answer. Returns the
        answers, how many were computed here (billed to this request) and how many came from
        the shared cache (hits). A key left unpublished (an error, a cancellation) is handed
        back: its waiters look it up again."""
        assert self.cache is not None
        shared = self.shared
        found: dict[CacheKey, bytes] = {}
        computed = hits = 0
        try:
            pending = keys
            while pending:
                from_fleet, mine, theirs = (
                    await shared.claim(pending) if shared else ({}, pending, [])
                )
                hits += len(from_fleet)
                self.cache.stats.shared_hits += len(from_fleet)
                self._publish(from_fleet, found)
                if mine:
                    answers = await self._compute_led(mine)
                    self._publish(answers, found)
                    computed += answers.paid  # the rest the backend had (a snapshot): hits
                    hits += len(mine) - answers.paid
                pending = []
                if theirs:
                    answered, pending = await shared.wait(theirs)  # type: ignore[union-attr]
                    self.cache.stats.shared_waits += len(answered)
                    self._publish(answered, found)
            return found, computed, hits
        finally:  # no key may stay in flight with nobody to resolve it
            for key in keys:
                if (future := self.in_flight.pop(key, None)) is not None:
                    future.set_exception(LeaderGone())
                    future.exception()  # retrieved: nobody may be waiting

    async def _compute_led(self, keys: list[CacheKey]) -> LedAnswers:
        """The backend's answers for `keys` (whose locks this replica holds, if shared),
        written to the shared cache; on failure the locks are let go."""
        assert self.cache is not None
        first = keys[0]
        queries = [key.query for key in keys]
        try:
            answers = await self._compute(queries, first.topk, first.retriever, first.return_scores)
        except BaseException:
            if self.shared is not None:
                await asyncio.shield(self.shared.release(keys))
            raise
        computed = LedAnswers(zip(keys, answers, strict=True))
        computed.paid = paid_for(answers)
        self.cache.stats.misses += computed.paid
        if self.shared is not None:
            await self.shared.store(computed)  # before answering: the next replica finds it
        return computed

    def _publish(self, answers: dict[CacheKey, bytes], found: dict[CacheKey, bytes]) -> None:
        """Store answers in this replica's cache and resolve their waiters."""
        assert self.cache is not None
        for key, answer in answers.items():
            self.cache.put(key, answer)
            found[key] = answer
            if (future := self.in_flight.pop(key, None)) is not None:
                future.set_result(answer)

    async def _compute(
        self, queries: list[str], topk: int, retriever: str, return_scores: bool
    ) -> list[bytes]:
        """The backend's answers, after the emulated cost of a billed call (if configured)."""
        if self.emulator is not None:
            await self.emulator.charge(len(queries))
        return await self.backend.compute(queries, topk, retriever, return_scores)
