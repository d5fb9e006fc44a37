"""A snapshot's file: its JSON Lines format, checked whole on load (`load_snapshot`), and the
recording written only to a new file or over the one this server created (`write_own_file`)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import orjson
from pydantic import TypeAdapter, ValidationError

from core.errors import UserError
from retrieval_server.api import Document, ScoredDocument

SNAPSHOT_KIND = "hdr search snapshot"
SNAPSHOT_VERSION = 1
SCORED_ANSWER = TypeAdapter(list[ScoredDocument])
PLAIN_ANSWER = TypeAdapter(list[Document])


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
