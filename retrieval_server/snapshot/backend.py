"""A snapshot served (`SnapshotBackend`, the `Backend` of `retrieval_server.serving.answers`)
and recorded (`SnapshotRecorder`), and what /health says of both."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from core.errors import UserError
from core.fingerprint import digest
from retrieval_server.api import SnapshotReport
from retrieval_server.serving.answers import Computed
from retrieval_server.snapshot.config import SnapshotConfig
from retrieval_server.snapshot.file import (
    Snapshot,
    SnapshotKey,
    load_snapshot,
    write_own_file,
)
from retrieval_server.upstream.proxy import UpstreamBackend, UpstreamError

log = logging.getLogger(__name__)
MISSING_SHOWN = 3  # queries a refusal names; the rest are counted
QUERY_SHOWN_CHARS = 80


class SnapshotMiss(UpstreamError):
    """Queries the snapshot does not hold, with nothing live to ask (answered 404)."""


@dataclass
class SnapshotCounts:
    """Since start: queries answered from the snapshot, refused as missing, fetched live."""

    served: int = 0
    missing: int = 0
    added: int = 0


class SnapshotBackend:
    """Answers from a snapshot (the `Backend` of `retrieval_server.serving.answers`); a query it
    does not hold is refused, or forwarded to `live` and added."""

    def __init__(self, snapshot: Snapshot, path: Path, live: UpstreamBackend | None = None) -> None:
        self.snapshot = snapshot
        self.path = path
        self.live = live
        self.counts = SnapshotCounts()
        # what is forwarded is billed: it runs to its end, as the proxy's forwards do
        self.finishes_abandoned = live is not None

    def fingerprint(self, digits: int) -> str:
        """The cache's fingerprint: the snapshot as loaded (never a live backend's, so no
        answer cached from a live run is served in its place)."""
        return digest({"snapshot": self.snapshot.backend, "sha256": self.snapshot.sha256},
                      length=digits)  # fmt: skip

    async def compute(
        self, queries: list[str], topk: int, retriever: str, return_scores: bool
    ) -> list[bytes]:
        keys = [SnapshotKey(retriever, topk, return_scores, query) for query in queries]
        missing = [key for key in dict.fromkeys(keys) if key not in self.snapshot.answers]
        if missing and self.live is None:
            self.counts.missing += len(missing)
            raise SnapshotMiss(404, self._refusal(missing, topk, return_scores, retriever))
        if missing:
            fetched = await self.live.compute(  # type: ignore[union-attr]
                [key.query for key in missing], topk, retriever, return_scores
            )
            now = time.time()
            for key, answer in zip(missing, fetched, strict=True):
                self.snapshot.add(key, answer, now)
            self.counts.added += len(missing)
        self.counts.served += len(keys) - len(missing)
        # read, not computed: the client is told they were not billed (as a cache hit)
        return Computed([self.snapshot.answers[key] for key in keys], paid=len(missing))

    def _refusal(
        self, missing: list[SnapshotKey], topk: int, return_scores: bool, retriever: str
    ) -> str:
        shown = ", ".join(repr(key.query[:QUERY_SHOWN_CHARS]) for key in missing[:MISSING_SHOWN])
        more = f" and {len(missing) - MISSING_SHOWN} more" if len(missing) > MISSING_SHOWN else ""
        asked = f"topk {topk}, return_scores {str(return_scores).lower()}"
        if retriever:
            asked += f", retriever {retriever}"
        return (
            f"not in snapshot {self.path.name} ({asked}): {shown}{more}; a snapshot answers "
            "only what it recorded (snapshot.on_miss=forward with --web or --upstream fetches "
            "and adds it)"
        )


class SnapshotRecorder:
    """Writes `snapshot` to `path`: a new file at start, replaced (only while it is still
    the file created here) every `flush_s` seconds if it grew, and at close."""

    def __init__(self, path: Path, snapshot: Snapshot, flush_s: float) -> None:
        self.path = Path(path)
        self.snapshot = snapshot
        self.flush_s = flush_s
        self.written_entries = -1
        self.created: tuple[int, int] | None = None  # (device, inode) of the file made here
        self._flusher: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def record(
        self,
        queries: list[str],
        topk: int,
        retriever: str,
        return_scores: bool,
        answers: list[bytes],
    ) -> None:
        """A request's answers, as its client received them."""
        now = time.time()
        for query, answer in zip(queries, answers, strict=True):
            self.snapshot.add(SnapshotKey(retriever, topk, return_scores, query), answer, now)

    async def start(self) -> None:
        """Create the file (refused if it exists) and start the periodic writes."""
        await self.write()
        self._flusher = asyncio.get_running_loop().create_task(self._flush_periodically())

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            try:
                await self.write()
            except (OSError, UserError) as err:  # said once a period; the close tries again
                log.error("snapshot.record_path %s not written: %s", self.path, err)

    async def write(self) -> None:
        """Write the recording if it changed since the last write."""
        async with self._lock:
            entries = len(self.snapshot.answers)
            if entries == self.written_entries:
                return
            data = self.snapshot.encode()
            self.created = await asyncio.to_thread(write_own_file, self.path, data, self.created)
            self.written_entries = entries

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        try:
            await self.write()
        except (OSError, UserError) as err:
            log.error("snapshot.record_path %s not written: %s", self.path, err)


async def open_snapshot(config: SnapshotConfig, live: UpstreamBackend | None) -> SnapshotBackend:
    """The snapshot `config.path` (checked whole) as a backend, `live` fetching what it lacks
    (with on_miss forward)."""
    assert config.path is not None
    snapshot = await asyncio.to_thread(load_snapshot, config.path)
    return SnapshotBackend(snapshot, config.path, live if config.on_miss == "forward" else None)


def snapshot_report(backend: SnapshotBackend | None, recorder: SnapshotRecorder | None):
    """/health's account of the snapshot served and the one recorded (None: neither)."""
    if backend is None and recorder is None:
        return None
    counts = backend.counts if backend is not None else SnapshotCounts()
    return SnapshotReport(
        path=None if backend is None else str(backend.path),
        entries=len((backend or recorder).snapshot.answers),  # type: ignore[union-attr]
        served=counts.served,
        missing=counts.missing,
        added=counts.added,
        record_path=None if recorder is None else str(recorder.path),
    )
