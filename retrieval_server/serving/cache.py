"""The result cache: answers already computed, as the response JSON they were sent as.

A search against a static index is a pure function of (retriever, the query as the retriever
sees it, topk, return_scores) and of the index with the settings that decide its answers, so
a repeated query needs no second computation: `ResultCache` holds each query's answer as the
encoded JSON list that went into a response (`[{"document":...,"score":...},...]`), and a
hit is joined into the next response unchanged, byte for byte what the first computation
sent. Entries are bounded in bytes (least recently used out first) and may expire after
`ttl_s` (for a backend that is not static: a live web API behind `--upstream`).

A client may name a scope (`X-HDR-Cache-Scope`): its queries are then answered only from
answers computed under the same scope, so a training run's bill counts its own repeats and no
other run's (hdr's trainer names its run). Without a scope, clients share one cache.

Every key carries the index's fingerprint (`app.index_fingerprint`): one server serves one index
for its lifetime, so in memory the fingerprint is the cache's own; a cache persisted across
restarts (`persist_path`) is loaded only by a server whose fingerprint is the same, so a
rebuilt, reloaded or different index never serves old answers.

The byte count is what the entries hold, object by object (`sys.getsizeof`, which is what
the allocator is asked for): each entry's key tuple, query, answer, entry tuple and time; each
distinct scope string once, however many entries share it; and the ordered dict itself (its
table, which grows in steps, and its linked nodes). A test holds it within 1.1x of what
tracemalloc sees for small answers and for many scopes; `bench/search_cache.py` measures it at
the default bound.

Beside this process's cache, `cache.backend: redis` adds one shared by a fleet of replicas
(`retrieval_server.fleet`); this cache stays in front of it.
"""

from __future__ import annotations

import logging
import struct
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import orjson
from pydantic import Field, field_validator

from core.config import StrictModel
from core.errors import UserError
from core.paths import atomic_file

log = logging.getLogger(__name__)


class CacheKey(NamedTuple):
    """Everything of a request that decides one query's answer (the index's fingerprint is
    the cache's own), and the client's scope: a cache of its own where it names one."""

    scope: str  # the X-HDR-Cache-Scope header ("": the shared cache)
    retriever: str
    topk: int
    return_scores: bool
    query: str  # as the retriever sees it (after the server's truncation)


FILE_MAGIC = b"hdr-search-cache 1\n"
RECORD = struct.Struct("<IId")  # key length, answer length, stored at (unix seconds)


class CacheConfig(StrictModel):
    """The result cache in front of the retriever (or the upstream): exact for a static index."""

    enabled: bool = Field(
        default=True,
        description="Serve repeated queries from the cache and let concurrent identical "
        "queries wait on one computation; false: every query is computed (and billed).",
    )
    max_bytes: int = Field(
        default=256 * 2**20,
        ge=0,
        description="Most bytes the cached answers may hold (least recently used out first); "
        "0 stores nothing but still computes identical concurrent queries once.",
    )
    ttl_s: float | None = Field(
        default=None,
        gt=0,
        description="Seconds an answer stays valid; None: until evicted. Set it when the "
        "backend's answers change over time (a live web search behind --upstream).",
    )
    persist_path: Path | None = Field(
        default=None,
        description="File the cache is saved to when the server stops and loaded from when it "
        "starts (only answers of the same index fingerprint); None: memory only.",
    )
    backend: Literal["memory", "redis"] = Field(
        default="memory",
        description="memory: this server's cache alone. redis: also one cache shared by every "
        "replica pointed at redis_url (a miss one replica computed or paid for is a hit on all; "
        "identical queries in flight on several replicas are computed once), and, in proxy "
        "mode, one spend budget for all of them. This server's cache stays in front of it.",
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="The Redis of cache.backend=redis (redis://[:password@]host:port/db; "
        "rediss:// for TLS). Its password is never shown.",
    )
    redis_namespace: str = Field(
        default="hdr",
        min_length=1,
        description="Prefix of every key hdr writes in Redis: fleets that must not share a "
        "cache or a budget use different ones.",
    )
    redis_lock_s: float = Field(
        default=5.0,
        gt=0,
        description="Expiry of the lock a replica holds while it computes a query (renewed "
        "while it lives): a replica that dies holding it delays the others this long at most, "
        "then one of them takes the query over.",
    )
    redis_timeout_s: float = Field(
        default=1.0,
        gt=0,
        description="Deadline of one Redis command; past it (or on a refused connection) Redis "
        "counts as unreachable: the replica serves from its own cache and searches, the budget "
        "refuses misses (503), and Redis is tried again after redis_retry_s.",
    )
    redis_retry_s: float = Field(
        default=1.0, gt=0, description="Wait before an unreachable Redis is tried again."
    )
    redis_ttl_s: float = Field(
        default=30 * 86400.0,
        gt=0,
        description="Expiry of an answer in Redis when ttl_s is not set: every answer expires, "
        "so a Redis run with maxmemory-policy volatile-lru evicts answers and never the budget, "
        "which has no expiry.",
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str) -> str:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("cache.redis_url must start with redis://, rediss:// or unix://")
        return url


@dataclass
class CacheStats:
    """Queries since start: `hits` answered from the cache, `coalesced` by another request's
    computation in flight (or a duplicate in the same request), `misses` computed."""

    hits: int = 0
    misses: int = 0
    coalesced: int = 0
    evictions: int = 0
    expired: int = 0
    loaded: int = 0  # entries read from persist_path at start
    shared_hits: int = 0  # of the hits: found in the shared cache (another replica's answer)
    shared_waits: int = 0  # of the coalesced: computed by another replica while we waited


STORED_AT = sys.getsizeof(0.0)
ENTRY_TUPLE = sys.getsizeof((b"", 0.0))
EMPTY_DICTS = sys.getsizeof(OrderedDict()) + sys.getsizeof({})  # what an empty cache holds


def entry_bytes(key: CacheKey, value: bytes) -> int:
    """The objects one entry holds of its own: the key tuple, its query, the answer and the
    (answer, stored at) tuple with its float. Its scope string is counted once per scope, the
    dict's table and nodes with the dict (`ResultCache.bytes`)."""
    return (
        sys.getsizeof(key) + sys.getsizeof(key.query) + sys.getsizeof(value)
        + ENTRY_TUPLE + STORED_AT
    )  # fmt: skip


class ResultCache:
    """LRU of encoded answers, bounded in bytes, optionally expiring; not thread-safe (the
    event loop is its only user)."""

    def __init__(
        self,
        max_bytes: int,
        fingerprint: str,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.time,
        description: dict[str, Any] | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        # what the fingerprint is a digest of, where it is worth telling apart (a proxy's
        # upstream): written in the file's header, named in the warning for another's file
        self.description = description
        self.ttl_s = ttl_s
        self.clock = clock
        self.stats = CacheStats()
        # the persisted file it started from was another fingerprint's: never saved over
        self.keeps_foreign_file = False
        self.entries_bytes = 0  # every entry's own objects and each distinct scope once
        self._entries: OrderedDict[CacheKey, tuple[bytes, float]] = OrderedDict()
        self._scopes: dict[str, int] = {}  # scope -> entries holding it

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """What the cache holds: its entries, their scopes and its two dicts."""
        return self.entries_bytes + sys.getsizeof(self._entries) + sys.getsizeof(self._scopes)

    def get(self, key: CacheKey) -> bytes | None:
        """The answer stored for `key` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        value, stored_at = entry
        if self.ttl_s is not None and self.clock() - stored_at > self.ttl_s:
            self._drop(key)
            self.stats.expired += 1
            return None
        self._entries.move_to_end(key)
        return value

    def peek(self, key: CacheKey) -> bytes | None:
        """The answer stored for `key` if it has not expired, without counting a use."""
        entry = self._entries.get(key)
        if entry is None or (self.ttl_s is not None and self.clock() - entry[1] > self.ttl_s):
            return None
        return entry[0]

    def put(self, key: CacheKey, value: bytes, stored_at: float | None = None) -> None:
        """Store `value`, evicting the least recently used entries past `max_bytes`; an
        answer larger than the whole bound is not stored."""
        size = entry_bytes(key, value) + (0 if key.scope in self._scopes else scope_bytes(key))
        if size + EMPTY_DICTS > self.max_bytes:
            return
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (value, self.clock() if stored_at is None else stored_at)
        self.entries_bytes += entry_bytes(key, value)
        if self._scopes.setdefault(key.scope, 0) == 0:
            self.entries_bytes += scope_bytes(key)
        self._scopes[key.scope] += 1
        while self.bytes > self.max_bytes and self._entries:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.stats.evictions += 1

    def _drop(self, key: CacheKey) -> None:
        value, _ = self._entries.pop(key)
        self.entries_bytes -= entry_bytes(key, value)
        self._scopes[key.scope] -= 1
        if not self._scopes[key.scope]:
            del self._scopes[key.scope]
            self.entries_bytes -= scope_bytes(key)

    def items(self) -> Iterator[tuple[CacheKey, bytes, float]]:
        """Entries from least to most recently used."""
        for key, (value, stored_at) in self._entries.items():
            yield key, value, stored_at

    # --- persistence -------------------------------------------------------------------------

    def save(self, path: Path) -> int | None:
        """Write every entry to `path` (a temp file beside it, renamed over it when whole, so
        the file is never half-written; with the mode the file had); returns the entries
        written, or None when `path` now holds another fingerprint's cache, or something that
        is not a cache (written there since this server started): it is left as it is."""
        path = Path(path)
        if path.exists():
            try:
                with path.open("rb") as file:
                    check_cache_file(path, file.read(len(FILE_MAGIC)))
                    theirs = read_header(path, file)
            except (UserError, OSError) as err:
                log.warning("cache not saved: %s", err)
                return None
            if theirs.get("fingerprint") != self.fingerprint:
                log.warning(
                    "cache not saved: %s holds the answers of another index or settings "
                    "(fingerprint %s, this server's %s), written there since this server "
                    "started; it is left as it is",
                    path,
                    theirs.get("fingerprint"),
                    self.fingerprint,
                )
                return None
        header = {"fingerprint": self.fingerprint, "description": self.description}
        with atomic_file(path, "wb") as file:
            file.write(FILE_MAGIC)
            file.write(orjson.dumps(header) + b"\n")
            for key, value, stored_at in self.items():  # LRU order: reloads in that order
                key_json = orjson.dumps(list(key))
                file.write(RECORD.pack(len(key_json), len(value), stored_at))
                file.write(key_json)
                file.write(value)
        return len(self._entries)

    def load(self, path: Path) -> int:
        """Read the entries saved at `path` if they were made with this cache's fingerprint
        (and have not expired); returns how many were loaded (0 for another index's file)."""
        try:
            return self._load(path)
        except (struct.error, ValueError, TypeError) as err:  # orjson's errors are ValueErrors
            raise UserError(
                f"cache.persist_path {path} is an hdr search cache but damaged"
                f" ({type(err).__name__}); remove it or choose another path"
            ) from None

    def _load(self, path: Path) -> int:
        with Path(path).open("rb") as file:
            check_cache_file(path, file.read(len(FILE_MAGIC)))
            header = read_header(path, file)
            if header["fingerprint"] != self.fingerprint:
                log.warning(
                    "cache file %s holds answers of another index or settings (fingerprint "
                    "%s, this server's %s%s); starting with an empty cache and keeping the "
                    "file: this server's answers are not saved over it (remove it, or choose "
                    "another cache.persist_path, to save them)",
                    path,
                    header["fingerprint"],
                    self.fingerprint,
                    differences(header.get("description"), self.description),
                )
                self.keeps_foreign_file = True
                return 0
            before = len(self._entries)
            while head := file.read(RECORD.size):
                key_length, value_length, stored_at = RECORD.unpack(head)
                key = CacheKey(*orjson.loads(file.read(key_length)))
                value = file.read(value_length)
                if len(value) != value_length:
                    raise ValueError("the file ends inside an answer")
                if self.ttl_s is None or self.clock() - stored_at <= self.ttl_s:
                    self.put(key, value, stored_at)
        self.stats.loaded = len(self._entries) - before
        return self.stats.loaded


def scope_bytes(key: CacheKey) -> int:
    """A scope string, counted once however many entries share it (the app interns it)."""
    return sys.getsizeof(key.scope)


def read_header(path: Path, file) -> dict[str, Any]:
    """The header line after the magic line: a JSON object with the fingerprint; anything
    else is one UserError line (the file is left as it is)."""
    try:
        header = orjson.loads(file.readline())
    except ValueError:
        header = None
    if not isinstance(header, dict) or not isinstance(header.get("fingerprint"), str):
        raise UserError(
            f"cache.persist_path {path} is an hdr search cache but its header is damaged;"
            " remove it or choose another path"
        )
    return header


def differences(theirs: Any, ours: dict[str, Any] | None) -> str:
    """What two descriptions (of an upstream) disagree on, for the warning: '; upstream
    default_retriever was dense, is bm25', or nothing."""
    if not isinstance(theirs, dict) or ours is None:
        return ""
    changed = [
        f"{name} was {theirs.get(name)}, is {ours.get(name)}"
        for name in sorted(set(theirs) | set(ours))
        if theirs.get(name) != ours.get(name)
    ]
    return "; upstream " + ", ".join(changed) if changed else ""


def check_cache_file(path: Path, start: bytes) -> None:
    """Refuse (one line) a `persist_path` that exists but is not a cache file hdr wrote: it
    would be overwritten when the server stops."""
    if start != FILE_MAGIC:
        raise UserError(
            f"cache.persist_path {path} exists and is not an hdr search cache; hdr writes its "
            "cache only to a new file or over a cache file of its own: choose another path"
        )


def open_persisted(cache: ResultCache, path: Path | None) -> None:
    """Fill `cache` from `path` when it exists (a file of another kind is refused at start,
    before it could be overwritten at the end)."""
    if path is None or not Path(path).exists():
        return
    if Path(path).is_dir():
        raise UserError(f"cache.persist_path {path} is a folder; it takes a file")
    loaded = cache.load(path)
    log.info("cache: %d answers loaded from %s", loaded, path)
