"""The spend ledger of proxy mode: what the upstream has billed, what is reserved for calls in
flight, and the budget (`upstream.max_calls`, `upstream.max_spend`) checked against both.

A call (one query forwarded) is reserved before it is sent, so concurrent requests can never
overspend together, and settled when its outcome is known (`retrieval_server.upstream.proxy`
decides): billed when the upstream answered it, or when it was sent and no answer came (a timeout, a
connection lost after sending: `upstream.bill_timeouts`, on by default, since an API bills
what it received); released unbilled when it was never sent or the upstream refused it with an
error status. The budget counts what is *committed*: billed, plus reserved, plus what a server
that stopped without settling had reserved (`unsettled`: those calls may have been billed).

Three ledgers with one behaviour:

- `MemoryLedger`: this process's counts, forgotten at exit; only without a budget (hdr refuses
  a budget that a restart would forget: `ServerConfig` asks for a place to keep it).
- `FileLedger` (`upstream.spend_path`): written ahead to a file before each call is sent (a
  temporary file renamed over it, so never half-written), so a restart, even a kill -9 in the
  middle of a call, starts from everything spent and reserved; its settlements are written
  afterwards, in the background (a crash before they are written leaves them counted as
  unsettled, never as unspent). One server at a time: it holds an flock of `PATH.lock` beside
  the file while it runs, and a second server on the same file is refused at start in one line.
- `RedisLedger` (`cache.backend: redis`, in `retrieval_server.fleet`): one ledger for a fleet
  of replicas, checked and spent in one atomic step by Lua scripts. Each replica keeps a
  `FleetRecord` in `upstream.spend_path` (which budget it joined), so a budget Redis loses is
  refused, never started again from a guess.

Spend is counted in whole calls: `max_spend` buys `floor(max_spend / price_per_call)` calls
(so 0.3 at 0.1 a call buys three calls, although 0.1 x 3 > 0.3 in binary floats).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from core.errors import UserError
from core.paths import atomic_file

if TYPE_CHECKING:
    from retrieval_server.upstream.config import UpstreamConfig

log = logging.getLogger(__name__)
SPEND_FILE_KIND = "hdr upstream spend"
FLEET_RECORD_KIND = "hdr fleet budget record"


class BudgetSpent(Exception):
    """A request needs calls the spend budget no longer allows (answered 429)."""


class BudgetUnavailable(Exception):
    """The budget cannot be checked (its shared store does not answer, its file cannot be
    written): calls are refused rather than spent without a count (answered 503)."""


@dataclass
class SpendTotals:
    """The ledger's totals: calls billed and their spend, and everything the budget counts
    (`committed`: billed, reserved for calls in flight, unsettled by a server that stopped)."""

    calls: int = 0
    spent: float = 0.0
    committed_calls: int = 0
    committed_spend: float = 0.0


def calls_left(config: UpstreamConfig, committed_calls: int, committed_spend: float) -> int:
    """Whole calls the budget still allows beside what is committed (sys.maxsize: no limit)."""
    left = sys.maxsize
    if config.max_calls is not None:
        left = min(left, config.max_calls - committed_calls)
    if config.max_spend is not None and config.price_per_call > 0:
        affordable = (config.max_spend - committed_spend) / config.price_per_call
        left = min(left, math.floor(affordable + 1e-9))
    return max(left, 0)


def refusal(config: UpstreamConfig, totals: SpendTotals, needed: int) -> BudgetSpent:
    """The one-line 429 for a request of `needed` calls beyond the budget."""
    by_calls = config.max_calls is not None and totals.committed_calls + needed > config.max_calls
    budget = (
        f"upstream.max_calls {config.max_calls}"
        if by_calls
        else f"upstream.max_spend {config.max_spend:g}"
    )
    left = calls_left(config, totals.committed_calls, totals.committed_spend)
    return BudgetSpent(
        f"upstream budget spent: {budget} leaves {left} calls, this request needs {needed} "
        f"({totals.calls} billed so far); cached queries are still answered"
    )


class MemoryLedger:
    """Billed and reserved calls of this process (the base of `FileLedger`)."""

    where = "memory"

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self.billed_calls = 0
        self.billed_spend = 0.0
        self.unsettled_calls = 0  # reserved by an earlier server that stopped without settling
        self.unsettled_spend = 0.0
        self.reserved = 0  # calls reserved now, in flight

    @property
    def limited(self) -> bool:
        return self.config.max_calls is not None or self.config.max_spend is not None

    def totals(self) -> SpendTotals:
        price = self.config.price_per_call
        return SpendTotals(
            calls=self.billed_calls,
            spent=self.billed_spend,
            committed_calls=self.billed_calls + self.unsettled_calls + self.reserved,
            committed_spend=self.billed_spend + self.unsettled_spend + self.reserved * price,
        )

    async def refresh(self) -> SpendTotals:
        """The totals as the ledger's store holds them now (a shared one is read again)."""
        return self.totals()

    async def reserve(self, calls: int) -> None:
        """Reserve `calls` before they are sent; raises `BudgetSpent` past the budget."""
        totals = self.totals()
        if calls > calls_left(self.config, totals.committed_calls, totals.committed_spend):
            raise refusal(self.config, totals, calls)
        self.reserved += calls

    def settle(self, reserved: int, billed: int) -> None:
        """`reserved` calls have their outcome: `billed` of them count as spent, the rest are
        released. Never blocks and never fails (a store is written in the background)."""
        self.reserved -= reserved
        self.billed_calls += billed
        self.billed_spend += billed * self.config.price_per_call

    async def close(self) -> None:
        pass


class FileLedger(MemoryLedger):
    """`MemoryLedger` kept in `upstream.spend_path`: loaded at start, written ahead of every
    reservation (the reservation is in the file before its call is sent) and after
    settlements. The file is JSON; it is only ever written over a spend file of the same
    upstream, and it keeps the mode it had."""

    where = "file"

    def __init__(self, config: UpstreamConfig, path: Path, upstream: str) -> None:
        super().__init__(config)
        self.path = Path(path)
        self.upstream = upstream  # the upstream as shown (no secrets): the file is its spend
        self._version = 0  # of the in-memory state; bumped by every change
        self._written = 0  # the version the file holds
        self._write_lock = asyncio.Lock()
        self._background: asyncio.Task[None] | None = None
        self._lock_fd = hold_spend_lock(self.path)  # this server's alone until it closes
        try:
            self._load()
        except BaseException:
            os.close(self._lock_fd)
            raise

    def _load(self) -> None:
        if not self.path.exists():
            return
        if self.path.is_dir():
            raise UserError(f"upstream.spend_path {self.path} is a folder; it takes a file")
        data = read_spend_file(self.path)
        if data["upstream"] != self.upstream:
            raise UserError(
                f"upstream.spend_path {self.path} holds the spend of upstream {data['upstream']},"
                f" not of {self.upstream}; give this upstream a spend file of its own"
            )
        self.billed_calls = data["calls"]
        self.billed_spend = data["spent"]
        self.unsettled_calls = data["unsettled_calls"]
        self.unsettled_spend = data["unsettled_spend"]
        if self.unsettled_calls:
            log.warning(
                "upstream.spend_path %s: %d calls were in flight when the last server stopped;"
                " they count as spent (the upstream may have billed them)",
                self.path,
                self.unsettled_calls,
            )

    def _snapshot(self) -> bytes:
        # what is reserved now is unsettled for whoever reads the file after a crash
        price = self.config.price_per_call
        data = {
            "kind": SPEND_FILE_KIND,
            "upstream": self.upstream,
            "calls": self.billed_calls,
            "spent": self.billed_spend,
            "unsettled_calls": self.unsettled_calls + self.reserved,
            "unsettled_spend": self.unsettled_spend + self.reserved * price,
        }
        return orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n"

    async def _write(self) -> None:
        """Bring the file up to the current version (one write serves every change before
        it); raises OSError when it cannot be written."""
        async with self._write_lock:
            if self._written >= self._version:
                return
            version, data = self._version, self._snapshot()
            await asyncio.to_thread(write_keeping_mode, self.path, data)
            self._written = version

    async def reserve(self, calls: int) -> None:
        await super().reserve(calls)
        self._version += 1
        try:
            await self._write()
        except OSError as err:
            self.reserved -= calls
            self._version += 1
            raise BudgetUnavailable(
                f"upstream.spend_path {self.path} cannot be written ({err.strerror or err}); "
                "no call is sent whose reservation is not on disk"
            ) from None

    def settle(self, reserved: int, billed: int) -> None:
        super().settle(reserved, billed)
        self._version += 1
        if self._background is None or self._background.done():
            self._background = asyncio.get_running_loop().create_task(self._write_settled())

    async def _write_settled(self) -> None:
        try:
            await self._write()
        except OSError as err:  # the next reservation writes again (and refuses if it cannot)
            log.error("upstream.spend_path %s cannot be written: %s", self.path, err)

    async def close(self) -> None:
        if self._background is not None:
            with contextlib.suppress(Exception):
                await self._background
        try:
            await self._write()
        except OSError as err:
            log.error("upstream.spend_path %s cannot be written: %s", self.path, err)
        finally:
            os.close(self._lock_fd)


def read_spend_file(path: Path) -> dict[str, Any]:
    """The spend file at `path`, checked; anything else (another file, a damaged one) is one
    UserError line, and the file is left as it is. A file that may be a spend file cut short
    (empty, or not JSON but naming the spend file's kind) is called damaged, never another's
    file: a new path would start the budget again from zero."""
    try:
        content = path.read_bytes()
    except OSError as err:
        raise UserError(
            f"upstream.spend_path {path} cannot be read ({err.strerror or err})"
        ) from None
    try:
        data = orjson.loads(content)
    except ValueError:
        data = None
    fields = {"upstream": str, "calls": int, "spent": float, "unsettled_calls": int,
              "unsettled_spend": float}  # fmt: skip
    damaged = (
        f"upstream.spend_path {path} is an hdr spend file but damaged (%s); restore it from a"
        " backup, or correct it by hand, before spending again (a new spend file would start"
        " the budget again from zero)"
    )
    if data is None and (not content.strip() or SPEND_FILE_KIND.encode() in content):
        raise UserError(damaged % ("empty" if not content.strip() else "cut short: not JSON"))
    if not isinstance(data, dict) or data.get("kind") != SPEND_FILE_KIND:
        raise UserError(
            f"upstream.spend_path {path} exists and is not an hdr spend file; hdr writes its"
            " spend only to a new file or over a spend file of its own: choose another path"
        )
    for name, kind in fields.items():
        value = data.get(name)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = data[name] = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise UserError(damaged % repr(name))
        if kind is not str and not (0 <= value < math.inf):  # also refuses NaN
            raise UserError(damaged % f"{name!r} is {value}, not a count")
    return data


def write_keeping_mode(path: Path, data: bytes) -> None:
    with atomic_file(path, "wb") as file:
        file.write(data)


class FleetRecord:
    """A replica's record of the fleet's budget (`upstream.spend_path` with `cache.backend:
    redis`): which budget it is (its Redis key, and the id Redis's budget was created with)
    and the fleet's totals as this replica last saw them. Redis holds the count; this file is
    what tells a replica, a restarted one too, that the budget existed, so a budget Redis lost
    (restarted empty, flushed, evicted) is refused rather than started again from zero. The
    totals it keeps are a lower bound of the fleet's (other replicas spend too): they are shown,
    never used to refill the count."""

    def __init__(self, path: Path, upstream: str, budget_key: str) -> None:
        self.path = Path(path)
        self.upstream = upstream  # as shown (no secrets)
        self.budget_key = budget_key
        self.budget_id: str | None = None
        self.seen = SpendTotals()
        self._lock_fd: int | None = hold_spend_lock(self.path)
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let another server take this record (once this one has stopped)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _load(self) -> None:
        if not self.path.exists():
            return
        if self.path.is_dir():
            raise UserError(f"upstream.spend_path {self.path} is a folder; it takes a file")
        try:
            data = orjson.loads(self.path.read_bytes())
        except (OSError, ValueError):
            data = None
        if not isinstance(data, dict) or data.get("kind") != FLEET_RECORD_KIND:
            raise UserError(
                f"upstream.spend_path {self.path} exists and is not an hdr fleet budget record"
                " (with cache.backend=redis it holds this replica's record of the fleet's"
                " budget); hdr writes it only to a new file or over a record of its own"
            )
        seen = data.get("seen")
        fields = ("calls", "spent", "committed_calls", "committed_spend")
        if (
            not isinstance(data.get("budget_id"), str)
            or not isinstance(seen, dict)
            or not all(isinstance(seen.get(name), int | float) for name in fields)
        ):
            raise UserError(
                f"upstream.spend_path {self.path} is an hdr fleet budget record but damaged;"
                " restore it from a backup, or correct it by hand, before spending again"
            )
        if data.get("budget_key") != self.budget_key:
            raise UserError(
                f"upstream.spend_path {self.path} records the fleet budget {data.get('budget_key')}"
                f" (upstream {data.get('upstream')}), not this one ({self.budget_key}, upstream"
                f" {self.upstream}); give this budget a record of its own"
            )
        self.budget_id = data["budget_id"]
        self.seen = SpendTotals(
            calls=int(seen["calls"]),
            spent=float(seen["spent"]),
            committed_calls=int(seen["committed_calls"]),
            committed_spend=float(seen["committed_spend"]),
        )

    def write(self) -> None:
        """Write the record whole (a temporary file renamed over it); raises OSError."""
        seen = self.seen
        data = {
            "kind": FLEET_RECORD_KIND,
            "upstream": self.upstream,
            "budget_key": self.budget_key,
            "budget_id": self.budget_id,
            "seen": {"calls": seen.calls, "spent": seen.spent,
                     "committed_calls": seen.committed_calls,
                     "committed_spend": seen.committed_spend},
        }  # fmt: skip
        write_keeping_mode(self.path, orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")


def hold_spend_lock(path: Path) -> int:
    """Lock `path` for this server alone (flock of `PATH.lock` beside it, created if missing
    and left in place); returns the descriptor that holds the lock until it is closed. A
    second server on the same file is one UserError line: two servers writing one spend
    would each send calls the other has already counted."""
    lock_path = path.with_name(path.name + ".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise UserError(
            f"upstream.spend_path {path}: its lock file {lock_path} cannot be opened"
            f" ({err.strerror or err})"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise UserError(
            f"upstream.spend_path {path} is in use by another running hdr serve (it holds"
            f" {lock_path}); one server per spend file: stop that one first, or give this"
            " server a spend file of its own"
        ) from None
    return fd
