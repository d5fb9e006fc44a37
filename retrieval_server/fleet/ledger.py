"""The fleet's spend budget in one Redis hash (`RedisLedger`), keyed by the upstream's identity
however its URL is spelled (`upstream_identity`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import ipaddress
import logging
import socket
import uuid
from typing import TYPE_CHECKING

import httpx

from core.errors import UserError
from retrieval_server.fleet.budget_scripts import CANCEL, INIT, REAP, RESERVE, SETTLE
from retrieval_server.fleet.link import RedisLink, SharedRefused, SharedUnavailable
from retrieval_server.upstream.spend import BudgetUnavailable, FleetRecord, SpendTotals, refusal

if TYPE_CHECKING:
    from retrieval_server.serving.cache import CacheConfig
    from retrieval_server.upstream.config import UpstreamConfig

log = logging.getLogger(__name__)
SETTLED_KEEP_S = 86400  # how long a replica's last settlement number is kept after its last


def upstream_identity(url: str) -> str:
    """The upstream as one budget, however its URL is spelled: scheme, host in lower case (an
    address in its canonical form; a name or address that is only this machine's loopback,
    `localhost` and `127.0.0.1` alike, as `loopback`), the port with the scheme's default
    filled in, path and query string (the user and password left out)."""
    parsed = httpx.URL(url)
    port = parsed.port or {"http": 80, "https": 443}.get(parsed.scheme, 0)
    host = parsed.host.lower().rstrip(".")
    try:
        addresses = {ipaddress.ip_address(host)}
    except ValueError:
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:  # unresolvable now: its name is its identity
            found = []
        addresses = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in found}
        if not (addresses and all(address.is_loopback for address in addresses)):
            addresses = set()
    if addresses:
        host = "loopback" if all(a.is_loopback for a in addresses) else str(addresses.pop())
    query = parsed.query.decode()
    return f"{parsed.scheme}://{host}:{port}{parsed.path.rstrip('/')}" + (
        f"?{query}" if query else ""
    )


def budget_key(namespace: str, identity: str) -> str:
    return f"{namespace}:budget:{hashlib.sha256(identity.encode()).hexdigest()[:32]}"


class RedisLedger:
    """The fleet's spend (`retrieval_server.upstream.spend`'s ledger interface) in one Redis hash.

    `reserve` is one RESERVE script: the budget checked against everything committed by every
    replica and the calls added, atomically, so replicas never overspend between them. `settle`
    queues a settlement (an id, the calls it had reserved in Redis, the calls billed) and a
    background task writes the queue with SETTLE, which applies each id once, so a settlement
    resent after a lost reply is not counted twice. While Redis is unreachable a budget fails
    closed (`BudgetUnavailable`); without a budget (price only) calls go on and are counted
    once Redis is back.

    The hash carries the id it was created with, and each replica keeps that id in its record
    (`upstream.spend_path`, `retrieval_server.upstream.spend.FleetRecord`). A hash that is gone
    while a record knows of it (Redis restarted empty, flushed, evicted) is never refilled: every
    reservation is refused in one line, and settlements wait, until Redis's data is restored
    (then each is applied once). Without a budget (price only) a lost count starts again from
    zero, with a log line. What no record can tell: a replica with a new spend file that
    starts after the loss finds no budget and creates one (the replicas whose records know the
    old one then refuse, naming the new id)."""

    where = "redis"

    def __init__(self, link: RedisLink, settings: CacheConfig, config: UpstreamConfig) -> None:
        self.link = link
        self.config = config
        self.key = budget_key(settings.redis_namespace, upstream_identity(config.url))
        # the key of a budget written before identities were normalised: taken over by INIT
        legacy = str(httpx.URL(config.url).copy_with(userinfo=b""))
        self.legacy_key = budget_key(settings.redis_namespace, legacy)
        # this replica's settlements are numbered; Redis keeps the last one applied
        self.token = uuid.uuid4().hex
        self.settled_key = f"{settings.redis_namespace}:settled:{self.token}"
        self.settlements = 0
        # this replica's reservations open in Redis (number -> calls), its liveness (expiring
        # unless renewed) and the budget's replicas, so that a replica that stopped with
        # reservations open is found by another, said in one line and counted as spent
        self.replica_prefix = self.key.replace(":budget:", ":replica:", 1) + ":"
        self.open_key = f"{self.replica_prefix}open:{self.token}"
        self.alive_key = f"{self.replica_prefix}alive:{self.token}"
        self.replicas_key = f"{self.replica_prefix}replicas"
        self.alive_ms = int(settings.redis_lock_s * 1000)
        self.reservations = 0  # numbers given so far
        self.open: collections.deque[list[int]] = collections.deque()  # [number, calls open]
        self.cancels: list[int] = []  # reservations whose reply was lost: released once
        self._liveness: asyncio.Task[None] | None = None
        self.record = (
            None
            if config.spend_path is None
            else FleetRecord(config.spend_path, config.shown_url, self.key)
        )
        self.budget_id = None if self.record is None else self.record.budget_id
        # the fleet's totals as last seen (shown in /health; never written back to Redis)
        self.known = SpendTotals() if self.record is None else self.record.seen
        # (settlement number, the budget it was reserved in, calls reserved in Redis, billed,
        # the open reservations it settles: (number, calls left open) pairs)
        self.pending: list[tuple[int, str | None, int, int, list[int]]] = []
        self.unrecorded = 0  # calls reserved while Redis was unreachable (no budget: allowed)
        self.refusal: str | None = None  # why this Redis may not keep a budget
        self.problem: str | None = None  # what the last script found wrong with the budget
        client = link.client
        self._init = client.register_script(INIT)
        self._reserve = client.register_script(RESERVE)
        self._settle = client.register_script(SETTLE)
        self._cancel = client.register_script(CANCEL)
        self._reap = client.register_script(REAP)
        self._flusher: asyncio.Task[None] | None = None
        self._flush_lock = asyncio.Lock()
        link.on_reachable.append(self._on_reachable)

    @property
    def limited(self) -> bool:
        return self.config.limited

    def _remember(self, committed_calls, committed_spend, calls, spent) -> SpendTotals:
        self.known = SpendTotals(
            calls=int(calls or 0),
            spent=float(spent or 0),
            committed_calls=int(committed_calls or 0),
            committed_spend=float(committed_spend or 0),
        )
        return self.known

    def totals(self) -> SpendTotals:
        return self.known

    async def join(self) -> None:
        """Find the fleet's budget in Redis, or create it where this replica knows of none
        (the first start of a budget); a budget its record knows of and Redis no longer has
        is left gone (every reservation then says so). Raises SharedUnavailable."""
        known = self.budget_id or "" if self.limited else ""
        args = [uuid.uuid4().hex, self.config.shown_url, known]
        keys = [self.key, self.legacy_key]
        found = await self.link.call(lambda r: self._init(keys=keys, args=args, client=r))
        if found is None:
            return
        found = found.decode() if isinstance(found, bytes) else str(found)
        if self.budget_id is None or not self.limited:
            self.budget_id = found
            await self._write_record()

    async def _write_record(self) -> None:
        if self.record is None:
            return
        self.record.budget_id, self.record.seen = self.budget_id, self.known
        try:
            await asyncio.to_thread(self.record.write)
        except OSError as err:
            log.error("upstream.spend_path %s cannot be written: %s", self.record.path, err)

    def _problem_line(self, problem: str) -> str:
        shown = self.link.shown_url
        where = "" if self.record is None else f" (its record: {self.record.path})"
        if problem == "missing":
            return (
                f"the fleet's upstream budget is gone from redis at {shown} (Redis lost its data:"
                f" restarted empty, flushed or evicted); this replica last saw"
                f" {self.known.committed_calls} calls committed{where}; calls are refused rather"
                " than counted again from a guess: restore Redis's data (its append-only file or"
                " a backup) to go on"
            )
        if problem.startswith("other "):
            return (
                f"redis at {shown} holds another upstream budget (id {problem[6:]}) than the one"
                f" this replica joined (id {self.budget_id}){where}: the budget was started anew"
                " there; calls are refused: restore Redis's data, or give this replica a new"
                " spend_path to join the new budget knowingly"
            )
        field = problem.removeprefix("damaged ")
        return (
            f"the fleet's upstream budget in redis at {shown} is damaged ({field} is not a"
            f" count, in {self.key}); calls are refused until it is corrected by hand"
        )

    async def refresh(self) -> SpendTotals:
        with contextlib.suppress(SharedUnavailable):
            await self._flush()
            fields = ("budget_id", "committed_calls", "committed_spend", "billed_calls",
                      "billed_spend")  # fmt: skip
            values = await self.link.call(lambda r: r.hmget(self.key, fields))
            if values[0] is not None and values[0].decode() == self.budget_id:
                with contextlib.suppress(ValueError):
                    self._remember(*values[1:])
            elif self.limited and self.budget_id is not None:
                self._report_problem(
                    "missing" if values[0] is None else f"other {values[0].decode()}"
                )
        return self.known

    @property
    def refusing(self) -> str | None:
        """Why every reservation is refused now (one line), for /health; None while the budget
        is there (past its limit, calls are refused as spent, not here)."""
        if self.refusal is not None:
            return self.refusal
        return None if self.problem is None else self._problem_line(self.problem)

    async def verify(self, at_start: bool) -> None:
        """Refuse a Redis that would forget or evict the budget: no append-only file, or an
        allkeys-* eviction policy. At start, one UserError line; later (Redis came back), the
        budget stays closed with the reason. A Redis that does not let INFO be read is
        trusted, with a warning; an unreachable one is checked when it comes back."""
        try:
            persistence = await self.link.call(lambda r: r.info("persistence"))
            memory = await self.link.call(lambda r: r.info("memory"))
        except SharedRefused as err:
            log.warning("%s to INFO; its durability is not checked", err)
            return
        except SharedUnavailable:
            return
        policy = str(memory.get("maxmemory_policy", "noeviction"))
        problem = None
        if int(persistence.get("aof_enabled", 0)) != 1:
            problem = "does not persist (appendonly no): a restart of Redis would forget the spend"
        elif policy.startswith("allkeys"):
            problem = f"may evict the budget (maxmemory-policy {policy})"
        elif policy == "noeviction" and int(memory.get("maxmemory", 0)) > 0:
            problem = (
                f"would fill with answers and then refuse every update of the budget"
                f" (maxmemory {memory.get('maxmemory')} with maxmemory-policy noeviction)"
            )
        if problem is None:
            self.refusal = None
            return
        self.refusal = (
            f"redis at {self.link.shown_url} {problem}; run it with appendonly yes and "
            "maxmemory-policy volatile-lru (or noeviction without maxmemory) to keep the"
            " upstream budget there"
        )
        if at_start:
            raise UserError(self.refusal)
        log.error("the upstream budget stays closed: %s", self.refusal)

    async def start(self) -> None:
        """At start: check this Redis may keep a budget (one UserError line if not), join the
        fleet's budget and say what replicas that stopped left open; an unreachable Redis is
        checked and joined when it comes back."""
        if self.limited:
            await self.verify(at_start=True)
        with contextlib.suppress(SharedUnavailable):
            await self.join()
            await self.reap()

    async def _on_reachable(self) -> None:
        if self.limited:
            await self.verify(at_start=False)
        if self.budget_id is None:
            with contextlib.suppress(SharedUnavailable):
                await self.join()
        self._start_flusher()

    async def reserve(self, calls: int, retried: bool = False) -> None:
        if self.refusal is not None:
            raise BudgetUnavailable(self.refusal)
        c = self.config
        try:
            await self._flush()  # what was settled may free budget
            if self.budget_id is None:
                await self.join()
            self.reservations += 1
            number = self.reservations
            args = [self.budget_id or "", calls, repr(c.price_per_call),
                    -1 if c.max_calls is None else c.max_calls,
                    -1 if c.max_spend is None else repr(c.max_spend),
                    number, self.token, self.alive_ms]  # fmt: skip
            keys = [self.key, self.open_key, self.alive_key, self.replicas_key]
            sent = self.link.will_send()
            try:
                status, *totals = await self.link.call(
                    lambda r: self._reserve(keys=keys, args=args, client=r)
                )
            except SharedRefused:
                raise
            except SharedUnavailable:
                if sent:  # perhaps made, its reply lost: released once Redis answers
                    self.cancels.append(number)
                    self._start_flusher()
                raise
        except SharedRefused as err:
            if not self.limited:  # nothing to protect: count it once Redis takes it
                self.unrecorded += calls
                return
            raise BudgetUnavailable(
                f"the upstream budget is shared in Redis and {err}; calls are refused until"
                " Redis accepts the budget's update"
            ) from None
        except SharedUnavailable as err:
            if not self.limited:  # nothing to protect: count it once Redis is back
                self.unrecorded += calls
                return
            raise BudgetUnavailable(
                f"the upstream budget is shared in Redis and {err}; calls are refused until it"
                " is back (queries in this replica's own cache are still answered; those only in"
                " Redis are not)"
            ) from None
        if isinstance(status, bytes):
            problem = status.decode()
            if not self.limited and not retried and not problem.startswith("damaged"):
                log.error("%s; without a budget, the spend is counted again from 0",
                          self._problem_line(problem))  # fmt: skip
                self.budget_id = None
                return await self.reserve(calls, retried=True)
            self._report_problem(problem)
            raise BudgetUnavailable(self._problem_line(problem))
        self.problem = None
        known = self._remember(*totals)
        if not status:
            raise refusal(c, known, calls)
        self.open.append([number, calls])
        if self._liveness is None or self._liveness.done():
            self._liveness = asyncio.get_running_loop().create_task(self._stay_alive())

    async def _stay_alive(self) -> None:
        """Renew this replica's liveness while it runs (a third of its expiry apart), and
        look for replicas that stopped with reservations open."""
        while True:
            with contextlib.suppress(SharedUnavailable):
                await self.link.call(lambda r: r.set(self.alive_key, "1", px=self.alive_ms))
                await self.reap()
            await asyncio.sleep(self.alive_ms / 3000)

    async def reap(self) -> None:
        """Count as spent, with one log line each, the reservations of replicas whose
        liveness expired (killed, or cut off from Redis past cache.redis_lock_s)."""
        found = await self.link.call(
            lambda r: self._reap(
                keys=[self.key, self.replicas_key], args=[self.replica_prefix], client=r
            )
        )
        for token, calls in zip(found[::2], found[1::2], strict=True):
            token = token.decode() if isinstance(token, bytes) else str(token)
            log.warning(
                "%d calls were in flight on a replica that stopped without settling them"
                " (replica %s of the fleet's budget at %s); they count as spent (the upstream"
                " may have billed them)",
                int(calls),
                token[:8],
                self.link.shown_url,
            )

    def _report_problem(self, problem: str) -> None:
        """One log line when the budget turns out gone, replaced or damaged."""
        if problem != self.problem:
            self.problem = problem
            log.error("%s", self._problem_line(problem))

    def settle(self, reserved: int, billed: int) -> None:
        unrecorded = min(self.unrecorded, reserved)
        self.unrecorded -= unrecorded
        self.settlements += 1
        left, closing = reserved - unrecorded, []
        while left > 0 and self.open:  # the oldest open reservations are settled first
            number, still_open = self.open[0]
            taken = min(still_open, left)
            left -= taken
            self.open[0][1] -= taken
            closing += [number, still_open - taken]
            if self.open[0][1] == 0:
                self.open.popleft()
        self.pending.append(
            (self.settlements, self.budget_id, reserved - unrecorded, billed, closing)
        )
        price = self.config.price_per_call
        k = self.known  # seen at once in /health; Redis's own totals replace it when written
        self.known = SpendTotals(
            calls=k.calls + billed,
            spent=k.spent + billed * price,
            committed_calls=k.committed_calls + billed - (reserved - unrecorded),
            committed_spend=k.committed_spend + (billed - reserved + unrecorded) * price,
        )
        self._start_flusher()

    def _start_flusher(self) -> None:
        waiting = self.pending or self.cancels
        if waiting and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.get_running_loop().create_task(self._flush_until_done())

    async def _flush_until_done(self) -> None:
        while self.pending or self.cancels:
            with contextlib.suppress(SharedUnavailable):
                await self._flush()
            if self.pending or self.cancels:  # Redis does not answer, or the budget is gone
                await asyncio.sleep(self.link.retry_s)
        await self._write_record()

    async def _flush(self) -> None:
        """Write the queued settlements, oldest first; raises SharedUnavailable when Redis
        does not answer; stops (the rest stay queued) when the budget is gone or damaged."""
        async with self._flush_lock:
            while self.cancels:
                args = [self.budget_id or "", self.cancels[0], repr(self.config.price_per_call)]
                status, *totals = await self.link.call(
                    lambda r, a=args: self._cancel(keys=[self.key, self.open_key], args=a, client=r)
                )
                if isinstance(status, bytes):
                    self._report_problem(status.decode())
                    return
                self.cancels.pop(0)
                self._remember(*totals)
            while self.pending:
                number, budget_id, reserved, billed, closing = self.pending[0]
                if budget_id != self.budget_id:  # reserved in a count lost since (no budget)
                    reserved = 0
                price = repr(self.config.price_per_call)
                args = [self.budget_id or "", reserved, billed, price, SETTLED_KEEP_S, number,
                        *closing]  # fmt: skip
                keys = [self.key, self.settled_key, self.open_key]
                status, *totals = await self.link.call(
                    lambda r, k=keys, a=args: self._settle(keys=k, args=a, client=r)
                )
                if isinstance(status, bytes):
                    self._report_problem(status.decode())
                    return
                self.pending.pop(0)
                self._remember(*totals)

    async def close(self) -> None:
        """Write what is queued, if Redis answers (a settlement it never gets leaves its calls
        counted as committed: spent, never unspent), and the record."""
        with contextlib.suppress(SharedUnavailable):
            await self._flush()
        for task in (self._flusher, self._liveness):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if not self.open and not self.pending:  # nothing open: this replica leaves no trace
            with contextlib.suppress(SharedUnavailable):
                await self.link.call(lambda r: r.delete(self.alive_key))
        await self._write_record()
        if self.record is not None:
            self.record.close()
