"""Frozen snapshots of what a server answered, and serving one back offline, byte for byte.

A live web search answers a query differently from one week to the next, so an evaluation run
against it cannot be rerun exactly, and a rerun pays again. A snapshot fixes that: a server
started with `snapshot.record_path=FILE` (`hdr serve ... --record-snapshot FILE`) writes, to
that new file, every answer its clients received (one per query: the first), and `hdr serve
--snapshot FILE` answers from it, offline and without a call, with the same bytes: a rerun's
responses are byte for byte the recorded run's. A query the snapshot does not hold is refused
in one line (404), or, with `snapshot.on_miss=forward` and a live backend beside it, fetched,
served and added: the recording (`record_path`, a new file) is then the served snapshot grown
by what was fetched.

The file is JSON Lines: a header (`kind`, `version`, the backend the answers came from as the
proxy describes it (its URL without secrets, the web API and its settings), when it was
written, the number of entries and the SHA-256 of the entry lines), then one line per answer:
the query, topk, return_scores, retriever, when a client first received it (`received_at`, unix
seconds) and the answer as the JSON text that went into the response. It is checked whole on
load (kind, version, checksum, count, every field, every answer a valid Search-R1 result list):
a damaged file is refused in one line, never served in part.

In a fleet each replica records what its own clients received (give each its own file).

Files: a recording is written only to a path that does not exist when the server starts
(created there at once, empty, so a wrong path fails at start), and is then replaced only while
it is still the file this server created (same inode): every `flush_s` seconds while answers
come in, and when the server stops. A file it did not create is never written over.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, NamedTuple

import orjson
from pydantic import Field, TypeAdapter, ValidationError

from core.config import StrictModel
from core.errors import UserError
from core.fingerprint import digest
from retrieval_server.api import Document, ScoredDocument, SnapshotReport
from retrieval_server.serving.answers import Computed
from retrieval_server.upstream.proxy import UpstreamBackend, UpstreamError

log = logging.getLogger(__name__)

SNAPSHOT_KIND = "hdr search snapshot"
SNAPSHOT_VERSION = 1
SCORED_ANSWER = TypeAdapter(list[ScoredDocument])
PLAIN_ANSWER = TypeAdapter(list[Document])
MISSING_SHOWN = 3  # queries a refusal names; the rest are counted
QUERY_SHOWN_CHARS = 80


class SnapshotConfig(StrictModel):
    """Serving a frozen snapshot (exact, offline), and recording one."""

    path: Path | None = Field(
        default=None,
        description="A snapshot to serve (`hdr serve --snapshot FILE`): every answer read from "
        "it, byte for byte what the recorded run received, without a call.",
    )
    on_miss: Literal["refuse", "forward"] = Field(
        default="refuse",
        description="A query the snapshot does not hold: refuse (404, one line), or forward "
        "it to the live backend given beside (--web or --upstream) and add its answer to "
        "the recording (needs record_path).",
    )
    record_path: Path | None = Field(
        default=None,
        description="A new file to record a snapshot in (`--record-snapshot FILE`): every "
        "answer a client received, one per query (the first), and the served snapshot's "
        "entries, if any. Written every flush_s seconds and when the server stops.",
    )
    flush_s: float = Field(
        default=30.0, gt=0, description="Seconds between writes of the recording (if it grew)."
    )


class SnapshotKey(NamedTuple):
    """What decides an answer in a snapshot (a client's cache scope does not)."""

    retriever: str
    topk: int
    return_scores: bool
    query: str


@dataclass
class Snapshot:
    """Answers by key, in the order they were first received, and where they came from."""

    backend: dict[str, Any]
    answers: dict[SnapshotKey, bytes] = field(default_factory=dict)
    received_at: dict[SnapshotKey, float] = field(default_factory=dict)
    sha256: str = ""  # of the entries as loaded ("": a new recording)

    def add(self, key: SnapshotKey, answer: bytes, when: float) -> None:
        """Keep `answer` for `key` unless one is kept already (the first received stays)."""
        if key not in self.answers:
            self.answers[key] = answer
            self.received_at[key] = when

    def encode(self) -> bytes:
        """The snapshot file's bytes: its header line, then one line per entry."""
        lines = [
            orjson.dumps(
                {
                    "query": key.query,
                    "topk": key.topk,
                    "return_scores": key.return_scores,
                    "retriever": key.retriever,
                    "received_at": self.received_at[key],
                    "answer": answer.decode("utf-8"),
                }
            )
            + b"\n"
            for key, answer in self.answers.items()
        ]
        entries = b"".join(lines)
        header = {
            "kind": SNAPSHOT_KIND,
            "version": SNAPSHOT_VERSION,
            "backend": self.backend,
            "written_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "entries": len(lines),
            "sha256": hashlib.sha256(entries).hexdigest(),
        }
        return orjson.dumps(header) + b"\n" + entries


def load_snapshot(path: Path) -> Snapshot:
    """The snapshot at `path`, checked whole; anything else is one UserError line."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise UserError(f"snapshot {path} cannot be read: {err.strerror or err}") from None
    head, _, entries = data.partition(b"\n")
    header = _json(head)
    if not isinstance(header, dict) or header.get("kind") != SNAPSHOT_KIND:
        raise UserError(
            f"{path} is not an hdr search snapshot (one is written by hdr serve "
            "--record-snapshot FILE)"
        )
    if header.get("version") != SNAPSHOT_VERSION:
        raise UserError(
            f"snapshot {path} is of version {header.get('version')!r}; this hdr reads version "
            f"{SNAPSHOT_VERSION}"
        )

    def damaged(reason: str) -> UserError:
        return UserError(
            f"snapshot {path} is damaged ({reason}); a snapshot is served only whole and "
            "unchanged: restore it from where it came"
        )

    if hashlib.sha256(entries).hexdigest() != header.get("sha256"):
        raise damaged("its entries do not match the checksum in its header")
    backend = header.get("backend")
    if not isinstance(backend, dict):
        raise damaged("its header names no backend")
    lines = entries.split(b"\n")
    if lines.pop() != b"":
        raise damaged("its last line is cut")
    if len(lines) != header.get("entries"):
        raise damaged(f"{len(lines)} entries where its header says {header.get('entries')!r}")
    snapshot = Snapshot(backend, sha256=header["sha256"])
    for number, line in enumerate(lines, start=2):
        key, answer, when = _entry(_json(line), number, damaged)
        if key in snapshot.answers:
            raise damaged(f"line {number} repeats a query")
        snapshot.add(key, answer, when)
    return snapshot


def _entry(entry: Any, number: int, damaged) -> tuple[SnapshotKey, bytes, float]:
    """One entry line's key, answer and time, checked."""
    kinds = {"query": str, "topk": int, "return_scores": bool, "retriever": str,
             "received_at": (int, float), "answer": str}  # fmt: skip
    if not isinstance(entry, dict):
        raise damaged(f"line {number} is not a JSON object")
    for name, kind in kinds.items():
        value = entry.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise damaged(f"line {number}: {name!r} is missing or of the wrong type")
    answer = entry["answer"].encode("utf-8")
    adapter = SCORED_ANSWER if entry["return_scores"] else PLAIN_ANSWER
    try:
        adapter.validate_python(orjson.loads(answer))
    except (ValueError, ValidationError):
        raise damaged(f"line {number}: its answer is not a Search-R1 result list") from None
    key = SnapshotKey(entry["retriever"], entry["topk"], entry["return_scores"], entry["query"])
    return key, answer, float(entry["received_at"])


def _json(line: bytes) -> Any:
    try:
        return orjson.loads(line)
    except ValueError:
        return None


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


def write_own_file(path: Path, data: bytes, created: tuple[int, int] | None) -> tuple[int, int]:
    """Write `data` to `path`: as a new file (`created` None: refused if `path` exists), or
    over the file this process created (`created`: its device and inode; refused if `path` is
    now another file). Returns the device and inode of what `path` now is."""
    if created is None:
        try:
            with path.open("xb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
        except FileExistsError:
            raise UserError(
                f"snapshot.record_path {path} exists; hdr records a snapshot only in a new "
                "file: move it or choose another path"
            ) from None
        except OSError as err:
            raise UserError(
                f"snapshot.record_path {path} cannot be created: {err.strerror or err}"
            ) from None
        info = path.stat()
        return info.st_dev, info.st_ino
    try:
        info = path.stat()
        now = (info.st_dev, info.st_ino)
    except FileNotFoundError:
        now = None
    if now != created:
        raise UserError(
            f"snapshot.record_path {path} was moved or replaced since this server created it; "
            "it is not written over"
        )
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with temporary.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    info = path.stat()
    return info.st_dev, info.st_ino


def check_new_record_path(path: Path | None) -> None:
    """Before anything loads: a recording's path must not exist."""
    if path is not None and (path.exists() or path.is_symlink()):
        raise UserError(
            f"snapshot.record_path {path} exists; hdr records a snapshot only in a new file: "
            "move it or choose another path"
        )


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
