"""Micro-batching with a bounded queue, fair slicing and a supervised worker.

Each request becomes a `PendingSearch` in a queue bounded in *queries* (`max_queued_queries`):
a request that would overflow it raises `Overloaded` at once (the app answers 503 +
Retry-After), except that an empty queue always admits one request, however large.

One worker task builds each batch from what is queued, up to `max_batch_queries` queries, and
runs one search per retriever over them in a worker thread, so the event loop keeps accepting
requests meanwhile. An idle server searches a lone request at once, with no fixed wait; while a
batch is searched the next one accumulates, so batches grow with load. (`batch_wait_ms > 0` adds
an optional wait for company after the first request, off by default.) A request larger than a
batch is searched in slices that take turns with the other requests (a request with queries left
goes to the back of the queue), so 16,384 queries from one client do not block the others.

First in, first served across batches: a request that has arrived (its handler has started)
but not yet reached the queue when a batch is taken would wait a whole batch longer than the
requests around it, and at 32 closed-loop clients that is the tail. So a batch is taken once the
requests on their way have queued, or after `settle_turns` turns of the event loop at most (the
path from a request's handler to the queue takes two). A handler announces itself with
`arriving()` (a context variable carries the mark to `search`, which clears it when the request
queues; the handler clears it when it ends without queuing: a cache hit, an error). A lone
client never waits: with nobody on the way a batch starts at once.

A request whose caller stopped waiting (deadline passed, client disconnected: the awaiting
coroutine is cancelled) is abandoned: its unsearched queries leave the queue and are never
searched. If a batch's search raises, each request of the batch is retried alone, so one bad
request fails alone (`SearchFailed`). The worker is supervised: if its loop dies (anything
escaping the per-batch handling, a BaseException included), the batch in flight fails, the loop
restarts, and after more than `max_restarts` crashes within a minute the batcher gives up:
`healthy` turns False and every request is refused, so `/health` says 503 and an orchestrator
restarts the server.

A search that never returns (a hung retriever thread) cannot be killed from Python; the batcher
records when the running search started, and `unhealthy_reason` reports it once it has run
longer than `stall_after_s`, so `/health` turns 503 and a supervisor restarts the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from retrieval_server.serving.retrievers import Hit, Retriever

log = logging.getLogger(__name__)
CRASH_WINDOW_S = 60.0
# What the batcher answers per query and rank: a hit's document as response JSON (read by
# `fetch` in the search thread) and its score; the retrievers' `Hit` is (corpus row, score).
Passage = tuple[bytes, float]


@dataclass(eq=False)
class OnTheWay:
    """A request between its handler's start and the queue (see `MicroBatcher.arriving`)."""

    batcher: MicroBatcher
    batches_before: int  # batches started before the request arrived
    open: bool = True

    def close(self) -> None:
        if self.open:
            self.open = False
            self.batcher.approaching -= 1


ON_THE_WAY: contextvars.ContextVar[OnTheWay | None] = contextvars.ContextVar(
    "on_the_way", default=None
)


class Overloaded(Exception):
    """The request was not queued: `reason` is "queue full" or "unhealthy"."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SearchFailed(Exception):
    """The retriever failed on this request's queries (searched alone) or the worker crashed."""


@dataclass(eq=False)
class PendingSearch:
    """One request's queries; `next` is the first not yet taken into a batch."""

    queries: list[str]
    topk: int
    retriever: str
    result: asyncio.Future[list[list[Passage]]] = field(repr=False)
    passages: list[list[Passage] | None] = field(default_factory=list, repr=False)
    next: int = 0
    answered: int = 0

    def __post_init__(self) -> None:
        self.passages = [None] * len(self.queries)

    @property
    def remaining(self) -> int:
        return len(self.queries) - self.next

    @property
    def abandoned(self) -> bool:
        return self.result.done()


@dataclass(frozen=True)
class Slice:
    """Queries [lo, hi) of one pending request, taken into a batch."""

    pending: PendingSearch
    lo: int
    hi: int

    @property
    def queries(self) -> list[str]:
        return self.pending.queries[self.lo : self.hi]


@dataclass
class BatcherCounts:
    """Since start: worker restarts, searches that failed (after retrying members alone), and
    requests that reached the queue only after a batch that started after they arrived had
    left without them (first in, first served broken: `fifo_misses`)."""

    worker_restarts: int = 0
    failed_requests: int = 0
    fifo_misses: int = 0


class MicroBatcher:
    """Queues searches and answers them batch by batch (start it in the app lifespan)."""

    def __init__(
        self,
        retrievers: dict[str, Retriever],
        *,
        max_batch_queries: int,
        max_queued_queries: int,
        batch_wait_ms: float = 0.0,
        settle_turns: int = 4,
        max_restarts: int = 5,
        stall_after_s: float = 120.0,
        on_batch: Callable[[str, int], None] = lambda retriever, queries: None,
        fetch: Callable[[list[list[Hit]]], list[list[Passage]]],
    ) -> None:
        self.retrievers = retrievers
        self.max_batch_queries = max_batch_queries
        self.max_queued_queries = max_queued_queries
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.settle_turns = settle_turns  # loop turns a batch waits, at most, for arrivals
        self.max_restarts = max_restarts
        self.stall_after_s = stall_after_s
        self.on_batch = on_batch  # called with (retriever name, number of queries) per search
        # run on the hits in the search thread (reading their documents), so a batch costs
        # one thread hand-off; what it returns per query is what requests get, cut to topk
        self.fetch = fetch
        self.counts = BatcherCounts()
        self.queued_queries = 0  # waiting or being searched, all requests together
        self.approaching = 0  # requests whose handlers started and that have not queued yet
        self.batches_started = 0
        self.gave_up = False
        self._waiting: deque[PendingSearch] = deque()
        self._wakeup = asyncio.Event()
        self._in_flight: set[Slice] = set()
        self._crashes: deque[float] = deque()
        self._worker: asyncio.Task[None] | None = None
        self._search_started: float | None = None  # monotonic start of the running search

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._supervise(), name="batcher")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None

    @property
    def healthy(self) -> bool:
        """The worker runs and has not given up."""
        return self._worker is not None and not self._worker.done() and not self.gave_up

    @property
    def search_running_s(self) -> float:
        """Seconds the running search has taken so far; 0 when none runs."""
        started = self._search_started
        return 0.0 if started is None else time.monotonic() - started

    def unhealthy_reason(self) -> str | None:
        """Why the batcher cannot serve (one line), or None while it can."""
        if self.gave_up:
            return f"batch worker gave up after {len(self._crashes)} crashes within a minute"
        if not self.healthy:
            return "batch worker is not running"
        running = self.search_running_s
        if running > self.stall_after_s:
            return (
                f"a search has not returned for {running:.0f} s "
                f"(search_stall_s {self.stall_after_s:g}); the search thread looks hung"
            )
        return None

    @property
    def waiting_requests(self) -> int:
        return len(self._waiting)

    # --- the caller's side -----------------------------------------------------------------

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Around a request's handling: the request counts as on its way to the queue until
        `search` queues it or the block ends, so the batch worker waits for it (FIFO)."""
        mark = OnTheWay(self, self.batches_started)
        self.approaching += 1
        token = ON_THE_WAY.set(mark)
        try:
            yield
        finally:
            ON_THE_WAY.reset(token)
            mark.close()

    async def search(self, queries: list[str], topk: int, retriever: str) -> list[list[Passage]]:
        """Passages per query for one request. Raises `Overloaded` (not queued) or `SearchFailed`;
        cancelling the caller (deadline, disconnect) abandons the request's unsearched queries."""
        if not self.healthy:
            raise Overloaded("unhealthy")
        if self.queued_queries and self.queued_queries + len(queries) > self.max_queued_queries:
            raise Overloaded("queue full")
        pending = PendingSearch(
            queries, topk, retriever, asyncio.get_running_loop().create_future()
        )
        self.queued_queries += len(queries)
        self._waiting.append(pending)
        self._wakeup.set()
        mark = ON_THE_WAY.get()
        if mark is not None:
            if mark.batches_before < self.batches_started:  # a batch left without it
                self.counts.fifo_misses += 1
            mark.close()
        try:
            return await asyncio.shield(pending.result)
        except asyncio.CancelledError:
            self._abandon(pending)
            raise

    def _abandon(self, pending: PendingSearch) -> None:
        """Nothing more of `pending` is searched; its untaken queries leave the queue."""
        if not pending.result.done():
            pending.result.cancel()
        self.queued_queries -= pending.remaining
        pending.next = len(pending.queries)
        if pending in self._waiting:
            self._waiting.remove(pending)

    def _fail(self, pending: PendingSearch, error: BaseException) -> None:
        if not pending.result.done():
            self.counts.failed_requests += 1
            pending.result.set_exception(SearchFailed(f"search failed: {type(error).__name__}"))
        self._abandon(pending)

    # --- the worker ------------------------------------------------------------------------

    async def _supervise(self) -> None:
        """Run the batch loop; restart it when it dies, give up after too many crashes."""
        while True:
            try:
                await self._serve_forever()
            except asyncio.CancelledError:
                raise
            except BaseException as err:  # a dead worker must not leave requests hanging
                log.exception("retrieval batch worker crashed")
                for piece in list(self._in_flight):
                    self._finish(piece, None, err)
                self.counts.worker_restarts += 1
                now = time.monotonic()
                self._crashes.append(now)
                while self._crashes and now - self._crashes[0] > CRASH_WINDOW_S:
                    self._crashes.popleft()
                if len(self._crashes) > self.max_restarts:
                    self.gave_up = True
                    for pending in list(self._waiting):
                        self._fail(pending, err)
                    log.error("batch worker crashed %d times in a minute", len(self._crashes))
                    return

    async def _serve_forever(self) -> None:
        while True:
            batch = await self._collect()
            self._in_flight = set(batch)
            by_retriever: dict[str, list[Slice]] = {}
            for piece in batch:
                by_retriever.setdefault(piece.pending.retriever, []).append(piece)
            for name, pieces in by_retriever.items():
                await self._search_pieces(name, pieces)

    async def _collect(self) -> list[Slice]:
        """The next batch: slices of queued requests in turn, up to `max_batch_queries`."""
        while not self._waiting:
            self._wakeup.clear()
            await self._wakeup.wait()
        for _ in range(self.settle_turns):  # first in, first served: let arrivals queue
            if not self.approaching:
                break
            await asyncio.sleep(0)
        if self.batch_wait_s > 0:
            deadline = time.monotonic() + self.batch_wait_s
            while self._queued_untaken() < self.max_batch_queries:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except asyncio.TimeoutError:
                    break
        batch: list[Slice] = []
        size, unfinished = 0, []
        self.batches_started += 1
        while self._waiting and size < self.max_batch_queries:
            pending = self._waiting.popleft()
            take = min(pending.remaining, self.max_batch_queries - size)
            batch.append(Slice(pending, pending.next, pending.next + take))
            pending.next += take
            size += take
            if pending.remaining:
                unfinished.append(pending)
        self._waiting.extend(unfinished)  # behind the requests this batch did not reach
        return batch

    def _queued_untaken(self) -> int:
        return sum(pending.remaining for pending in self._waiting)

    async def _search_pieces(self, name: str, pieces: list[Slice]) -> None:
        """One retriever call for all `pieces`; if it fails, each piece is retried alone."""
        try:
            passages = await self._run_search(name, pieces)
        except Exception as err:
            if len(pieces) == 1:
                self._finish(pieces[0], None, err)
                return
            for piece in pieces:
                try:
                    own = await self._run_search(name, [piece])
                except Exception as alone_err:
                    self._finish(piece, None, alone_err)
                else:
                    self._finish(piece, own, None)
            return
        start = 0
        for piece in pieces:
            count = piece.hi - piece.lo
            self._finish(piece, passages[start : start + count], None)
            start += count

    async def _run_search(self, name: str, pieces: list[Slice]) -> list[list[Passage]]:
        queries = [query for piece in pieces for query in piece.queries]
        topk = max(piece.pending.topk for piece in pieces)
        self.on_batch(name, len(queries))
        self._search_started = time.monotonic()
        search, fetch = self.retrievers[name].search, self.fetch

        def search_and_fetch() -> list[list[Passage]]:
            hits = search(queries, topk)
            if len(hits) != len(queries):
                raise RuntimeError(f"retriever {name} gave {len(hits)} results for {len(queries)}")
            return fetch(hits)

        try:
            return await asyncio.to_thread(search_and_fetch)
        finally:
            self._search_started = None

    def _finish(
        self, piece: Slice, passages: list[list[Passage]] | None, error: BaseException | None
    ) -> None:
        """Account for a searched slice; answer its request when all its queries are in."""
        self._in_flight.discard(piece)
        self.queued_queries -= piece.hi - piece.lo
        pending = piece.pending
        if pending.abandoned:
            return
        if passages is None:
            log.warning("search failed for one request: %s", type(error).__name__)
            self._fail(pending, error or RuntimeError("search failed"))
            return
        for offset, query_passages in enumerate(passages):
            pending.passages[piece.lo + offset] = query_passages[: pending.topk]
        pending.answered += piece.hi - piece.lo
        if pending.answered == len(pending.queries):
            pending.result.set_result(pending.passages)  # type: ignore[arg-type]
