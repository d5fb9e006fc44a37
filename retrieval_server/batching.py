"""Micro-batching: concurrent requests are encoded and searched together.

Each request becomes a `PendingSearch` on an asyncio queue. One worker task takes the first
pending search together with everything else already queued (up to `max_batch_queries`
queries), then runs one search per retriever over all their queries in a worker thread, so the
event loop keeps accepting requests meanwhile. An idle server therefore searches a lone request
at once, with no fixed wait; while a batch is searched the next one accumulates, so batches grow
with load and throughput grows with concurrency. `batch_wait_ms > 0` adds an optional wait for
company after the first request (off by default). One request is never split: a request larger
than `max_batch_queries` is searched alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from retrieval_server.retrievers import Hit, Retriever


@dataclass
class PendingSearch:
    """One request's queries, waiting for its batch; `result` is set to its hits per query."""

    queries: list[str]
    topk: int
    retriever: str
    result: asyncio.Future[list[list[Hit]]] = field(repr=False)


class MicroBatcher:
    """Collects `PendingSearch`es and answers them batch by batch (start it in the app lifespan)."""

    def __init__(
        self,
        retrievers: dict[str, Retriever],
        batch_wait_ms: float,
        max_batch_queries: int,
        on_batch: Callable[[str, int], None] = lambda retriever, queries: None,
    ) -> None:
        self.retrievers = retrievers
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.max_batch_queries = max_batch_queries
        self.on_batch = on_batch  # called with (retriever name, number of queries) per search
        self._queue: asyncio.Queue[PendingSearch] = asyncio.Queue()
        self._carried: PendingSearch | None = None  # did not fit the last batch; goes first
        self._worker: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._run(), name="micro-batcher")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None

    async def search(self, queries: list[str], topk: int, retriever: str) -> list[list[Hit]]:
        """Hits per query for one request, searched together with whatever else is pending."""
        pending = PendingSearch(
            queries, topk, retriever, asyncio.get_running_loop().create_future()
        )
        await self._queue.put(pending)
        return await pending.result

    async def _collect(self) -> list[PendingSearch]:
        """The next batch: the first pending search, all already queued, then (only with
        `batch_wait_ms > 0`) those arriving within the wait."""
        first, self._carried = self._carried, None
        batch = [first if first is not None else await self._queue.get()]
        size = len(batch[0].queries)
        deadline = time.monotonic() + self.batch_wait_s
        while size < self.max_batch_queries:
            if self._queue.empty():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    pending = await asyncio.wait_for(self._queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
            else:
                pending = self._queue.get_nowait()
            if size + len(pending.queries) > self.max_batch_queries:
                self._carried = pending
                break
            batch.append(pending)
            size += len(pending.queries)
        return batch

    async def _run(self) -> None:
        while True:
            batch = await self._collect()
            by_retriever: dict[str, list[PendingSearch]] = {}
            for pending in batch:
                if not pending.result.done():  # the client may have gone away
                    by_retriever.setdefault(pending.retriever, []).append(pending)
            for name, group in by_retriever.items():
                await self._search_group(name, group)

    async def _search_group(self, name: str, group: list[PendingSearch]) -> None:
        """One retriever call for all queries of `group`, then each request gets its slice."""
        queries = [query for pending in group for query in pending.queries]
        topk = max(pending.topk for pending in group)
        self.on_batch(name, len(queries))
        try:
            hits = await asyncio.to_thread(self.retrievers[name].search, queries, topk)
        except Exception as err:  # answered as that request's 500 instead of killing the worker
            for pending in group:
                if not pending.result.done():
                    pending.result.set_exception(err)
            return
        start = 0
        for pending in group:
            own = hits[start : start + len(pending.queries)]
            start += len(pending.queries)
            if not pending.result.done():
                pending.result.set_result([query_hits[: pending.topk] for query_hits in own])
