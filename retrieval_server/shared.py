"""One cache and one budget for a fleet of `hdr serve` replicas, on Redis (`cache.backend: redis`).

Each replica keeps its own cache (`retrieval_server.cache.ResultCache`) in front; behind it, in
one Redis (a single server, or a primary with its replicas; not Redis Cluster, whose keys of
one script must share a slot):

- answers, `NS:answer:FINGERPRINT:SHA256(key)`: the answer's bytes, written by the replica that
  computed (or paid for) it, with an expiry (`cache.ttl_s`, else `cache.redis_ttl_s`), so a miss
  of one replica is a hit on every other, byte for byte. FINGERPRINT is the replica's own (its
  index and the settings that decide answers, or its upstream's description), so replicas of
  different indexes never share an answer;
- locks, `NS:lock:FINGERPRINT:SHA256(key)`: set if absent (with an expiry, `cache.redis_lock_s`,
  renewed while the holder lives), in the same step that finds no answer (CLAIM), by the
  replica that computes a query, and deleted by that holder alone when it writes the answer or
  gives up. A replica that finds a query locked waits for
  its answer (polling, 2 ms growing to 50 ms); when the lock goes without an answer (its
  holder failed, or died and the lock expired) it takes the query over. So identical queries
  in flight on several replicas are computed once;
- the budget of proxy mode, `NS:budget:SHA256(upstream URL)`: `RedisLedger`, one hash for the
  fleet, checked and spent in one step.

Every check-and-change is a Lua script (redis-py's `register_script`), so it is atomic. Redis
commands are not retried by the client: a reservation sent twice would spend twice.

Redis unreachable (a refused connection, or no answer within `cache.redis_timeout_s`): the
replica says so in one log line and in /health, serves from its own cache and its own searches
(as `cache.backend: memory` would; what it computes meanwhile is written to Redis once Redis is
back), and tries Redis again after `cache.redis_retry_s`. A budget
kept in Redis fails closed meanwhile: reservations are refused (misses answered 503, cached
queries still served), and the settlements of calls already sent wait in memory, each with an
id that makes it count once, until Redis is back. A budget is only kept in a Redis that
persists (append-only file on) and never evicts it (`maxmemory-policy` noeviction or
volatile-*: answers expire, the budget does not): `hdr serve` refuses any other at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import orjson

from core.errors import UserError
from retrieval_server.cache import CacheKey
from retrieval_server.spend import BudgetUnavailable, SpendTotals, refusal

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from retrieval_server.cache import CacheConfig
    from retrieval_server.upstream import UpstreamConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
FIRST_POLL_S, LAST_POLL_S = 0.002, 0.05  # a waiter's polls for another replica's answer
SETTLED_KEEP_S = 86400  # how long a settlement's id is kept (it counts once within that)
UNPUBLISHED_KEEP = 10_000  # answers kept to write once Redis is back (the oldest go first)

# KEYS: answer, lock, answer, lock, ...; ARGV: token, expiry (ms) -> per pair the answer if
# there is one, else 1 if this replica took the lock, else 0 (another holds it). One step, so
# an answer written between a lookup and a lock can never be computed again
CLAIM = """
local out = {}
for i = 1, #KEYS, 2 do
  local answer = redis.call('GET', KEYS[i])
  if answer then
    out[#out + 1] = answer
  else
    out[#out + 1] = redis.call('SET', KEYS[i + 1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0
  end
end
return out
"""
# KEYS: answer, lock, answer, lock, ... -> per pair the answer, else 1 if locked, else 0
PEEK = """
local out = {}
for i = 1, #KEYS, 2 do
  local answer = redis.call('GET', KEYS[i])
  if answer then
    out[#out + 1] = answer
  elseif redis.call('EXISTS', KEYS[i + 1]) == 1 then
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""
# KEYS: answer, lock, ...; ARGV: token, expiry (ms), one answer per pair
PUBLISH = """
for i = 1, #KEYS, 2 do
  redis.call('SET', KEYS[i], ARGV[2 + (i + 1) / 2], 'PX', ARGV[2])
  if redis.call('GET', KEYS[i + 1]) == ARGV[1] then redis.call('DEL', KEYS[i + 1]) end
end
return 1
"""
RELEASE = """
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then redis.call('DEL', key) end
end
return 1
"""
RENEW = """
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then redis.call('PEXPIRE', key, ARGV[2]) end
end
return 1
"""
# The budget hash: committed_calls / committed_spend (billed, reserved and unsettled: what the
# budget counts) and billed_calls / billed_spend. A hash that is gone (a Redis that lost its
# data) is seeded with the totals this replica last saw, never from zero.
BUDGET_PRELUDE = """
local function seed(key, a)
  if redis.call('EXISTS', key) == 0 then
    redis.call('HSET', key, 'committed_calls', a[1], 'committed_spend', a[2],
               'billed_calls', a[3], 'billed_spend', a[4], 'upstream', a[5])
  end
end
local function totals(key)
  return redis.call('HMGET', key, 'committed_calls', 'committed_spend', 'billed_calls',
                    'billed_spend')
end
"""
# KEYS: budget; ARGV: 5 seed values, calls, price, max_calls (-1: none), max_spend (-1: none)
RESERVE = (
    BUDGET_PRELUDE
    + """
seed(KEYS[1], ARGV)
local t = totals(KEYS[1])
local calls, price = tonumber(ARGV[6]), tonumber(ARGV[7])
local max_calls, max_spend = tonumber(ARGV[8]), tonumber(ARGV[9])
local ok = 1
if max_calls >= 0 and tonumber(t[1]) + calls > max_calls then ok = 0 end
if ok == 1 and max_spend >= 0 and price > 0
   and calls > math.floor((max_spend - tonumber(t[2])) / price + 1e-9) then ok = 0 end
if ok == 1 then
  redis.call('HINCRBY', KEYS[1], 'committed_calls', calls)
  redis.call('HINCRBYFLOAT', KEYS[1], 'committed_spend', calls * price)
  t = totals(KEYS[1])
end
return {ok, t[1], t[2], t[3], t[4]}
"""
)
# KEYS: budget, the settlement's id; ARGV: 5 seed values, reserved (in Redis), billed, price,
# how long the id is kept (s)
SETTLE = (
    BUDGET_PRELUDE
    + """
seed(KEYS[1], ARGV)
local reserved, billed, price = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[9]) then
  if billed ~= reserved then
    redis.call('HINCRBY', KEYS[1], 'committed_calls', billed - reserved)
    redis.call('HINCRBYFLOAT', KEYS[1], 'committed_spend', (billed - reserved) * price)
  end
  if billed > 0 then
    redis.call('HINCRBY', KEYS[1], 'billed_calls', billed)
    redis.call('HINCRBYFLOAT', KEYS[1], 'billed_spend', billed * price)
  end
end
return totals(KEYS[1])
"""
)


class SharedUnavailable(Exception):
    """Redis did not answer (or is waited out after a failure); the detail says why."""


def shown_redis_url(url: str) -> str:
    """The Redis URL without its user and password."""
    try:
        return str(httpx.URL(url).copy_with(userinfo=b""))
    except httpx.InvalidURL:
        return "(an invalid URL)"


class RedisLink:
    """A replica's Redis client and whether Redis answers. Every command goes through `call`:
    a failure marks Redis unreachable (one log line), and until `retry_s` has passed calls
    fail at once without trying; the first success after that says it is back."""

    def __init__(self, settings: CacheConfig, consequence: str) -> None:
        from redis.asyncio import Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.shown_url = shown_redis_url(settings.redis_url)
        self.retry_s = settings.redis_retry_s
        self.consequence = consequence  # what unreachable means here, for the log line
        self.client: Redis = Redis.from_url(
            settings.redis_url,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s,
            retry=Retry(NoBackoff(), 0),  # never resend: a reservation sent twice spends twice
        )
        self.reachable = True
        self.reason: str | None = None
        self.down_since: float | None = None  # unix time
        self._retry_at = 0.0
        self.on_reachable: list[Callable[[], Awaitable[None]]] = []  # run when Redis is back

    async def call(self, operation: Callable[[Redis], Awaitable[T]]) -> T:
        from redis.exceptions import RedisError

        if not self.reachable and time.monotonic() < self._retry_at:
            raise SharedUnavailable(self.reason)
        try:
            result = await operation(self.client)
        except (RedisError, OSError, asyncio.TimeoutError) as err:
            self._unreachable(err)
            raise SharedUnavailable(self.reason) from None
        if not self.reachable:
            self._back()
        return result

    def _unreachable(self, err: BaseException) -> None:
        self._retry_at = time.monotonic() + self.retry_s
        if self.reachable:
            self.reachable = False
            self.down_since = time.time()
            self.reason = f"redis at {self.shown_url} unreachable ({type(err).__name__})"
            log.warning(
                "%s: %s; trying again every %g s", self.reason, self.consequence, self.retry_s
            )

    def _back(self) -> None:
        down = time.time() - (self.down_since or time.time())
        self.reachable, self.reason, self.down_since = True, None, None
        log.warning("redis at %s is reachable again after %.1f s", self.shown_url, down)
        for hook in self.on_reachable:
            asyncio.get_running_loop().create_task(hook())

    async def check(self) -> None:
        """Try Redis now (at start): marks it unreachable, with the log line, if it is."""
        with contextlib.suppress(SharedUnavailable):
            await self.call(lambda r: r.ping())

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.aclose()


class SharedCache:
    """The fleet's answers and locks (see the module docstring). Every method degrades to
    "nothing shared" when Redis is unreachable: `claim` finds no answer and gives every query
    to this replica, `wait` hands the queries back, writes wait until Redis is back."""

    def __init__(self, link: RedisLink, settings: CacheConfig, fingerprint: str) -> None:
        self.link = link
        self.prefix = f"{settings.redis_namespace}:%s:{fingerprint}:"
        self.lock_ms = int(settings.redis_lock_s * 1000)
        self.answer_ms = int((settings.ttl_s or settings.redis_ttl_s) * 1000)
        self.token = secrets.token_hex(16)  # this replica's, in every lock it holds
        self.held: dict[str, int] = {}  # lock key -> this replica's leaders holding it
        self.took_over = 0  # queries computed here after their lock went without an answer
        # answers computed while Redis did not answer: written when it is back, so another
        # replica does not pay for them again (name of the answer -> (its lock, the answer))
        self.unpublished: dict[str, tuple[str, bytes]] = {}
        self._renewer: asyncio.Task[None] | None = None
        link.on_reachable.append(self._publish_the_unpublished)
        client = link.client
        self._claim, self._peek = client.register_script(CLAIM), client.register_script(PEEK)
        self._publish = client.register_script(PUBLISH)
        self._release, self._renew = client.register_script(RELEASE), client.register_script(RENEW)

    def _names(self, key: CacheKey) -> tuple[str, str]:
        digest = hashlib.sha256(orjson.dumps(list(key))).hexdigest()
        return self.prefix % "answer" + digest, self.prefix % "lock" + digest

    async def claim(
        self, keys: list[CacheKey]
    ) -> tuple[dict[CacheKey, bytes], list[CacheKey], list[CacheKey]]:
        """In one step: (the answers Redis holds, the keys this replica now holds the lock of,
        the keys another replica holds the lock of)."""
        names = [name for key in keys for name in self._names(key)]
        try:
            replies = await self.link.call(
                lambda r: self._claim(keys=names, args=[self.token, self.lock_ms], client=r)
            )
        except SharedUnavailable:
            return {}, list(keys), []
        answered, mine, theirs = {}, [], []
        for key, lock, reply in zip(keys, names[1::2], replies, strict=True):
            if isinstance(reply, bytes):
                answered[key] = reply
            elif reply == 1:
                mine.append(key)
                self.held[lock] = self.held.get(lock, 0) + 1
            else:
                theirs.append(key)
        if mine and (self._renewer is None or self._renewer.done()):
            self._renewer = asyncio.get_running_loop().create_task(self._renew_held())
        return answered, mine, theirs

    def _let_go(self, locks: list[str]) -> None:
        for lock in locks:
            if self.held.get(lock, 0) <= 1:
                self.held.pop(lock, None)
            else:
                self.held[lock] -= 1

    async def store(self, answers: dict[CacheKey, bytes]) -> None:
        """Write the answers this replica computed and release their locks; while Redis does
        not answer they wait (at most UNPUBLISHED_KEEP of them) until it is back."""
        names = [name for key in answers for name in self._names(key)]
        self._let_go(names[1::2])
        try:
            await self._write(names, list(answers.values()))
        except SharedUnavailable:
            for (answer, lock), value in zip(
                zip(names[::2], names[1::2], strict=True), answers.values(), strict=True
            ):
                self.unpublished[answer] = (lock, value)
            while len(self.unpublished) > UNPUBLISHED_KEEP:
                self.unpublished.pop(next(iter(self.unpublished)))

    async def _write(self, names: list[str], values: list[bytes]) -> None:
        args = [self.token, self.answer_ms, *values]
        await self.link.call(lambda r: self._publish(keys=names, args=args, client=r))

    async def _publish_the_unpublished(self) -> None:
        waiting, self.unpublished = self.unpublished, {}
        if waiting:
            names = [name for answer, (lock, _) in waiting.items() for name in (answer, lock)]
            try:
                await self._write(names, [value for _, value in waiting.values()])
            except SharedUnavailable:
                self.unpublished = {**waiting, **self.unpublished}

    async def release(self, keys: list[CacheKey]) -> None:
        """Give up the locks of `keys` without an answer (a failed computation): a waiting
        replica takes them over at once."""
        locks = [self._names(key)[1] for key in keys]
        self._let_go(locks)
        with contextlib.suppress(SharedUnavailable):
            await self.link.call(lambda r: self._release(keys=locks, args=[self.token], client=r))

    async def wait(self, keys: list[CacheKey]) -> tuple[dict[CacheKey, bytes], list[CacheKey]]:
        """Wait for the answers of `keys`, which other replicas hold the locks of: (the answers
        that came, the keys to claim again: their lock went without an answer, or Redis
        stopped answering)."""
        got: dict[CacheKey, bytes] = {}
        remaining, delay = list(keys), FIRST_POLL_S
        while remaining:
            names = [name for key in remaining for name in self._names(key)]
            try:
                replies = await self.link.call(lambda r, n=names: self._peek(keys=n, client=r))
            except SharedUnavailable:
                return got, remaining
            locked, orphaned = [], []
            for key, reply in zip(remaining, replies, strict=True):
                if isinstance(reply, bytes):
                    got[key] = reply
                else:
                    (locked if reply == 1 else orphaned).append(key)
            if orphaned:
                self.took_over += len(orphaned)
                return got, orphaned + locked
            remaining = locked
            if remaining:
                await asyncio.sleep(delay)
                delay = min(delay * 1.5, LAST_POLL_S)
        return got, []

    async def _renew_held(self) -> None:
        """Keep this replica's locks from expiring while it computes (a third of their
        expiry apart); ends when it holds none."""
        while self.held:
            await asyncio.sleep(self.lock_ms / 3000)
            locks = list(self.held)
            if locks:
                with contextlib.suppress(SharedUnavailable):
                    await self.link.call(
                        lambda r, k=locks: self._renew(
                            keys=k, args=[self.token, self.lock_ms], client=r
                        )
                    )

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer


class RedisLedger:
    """The fleet's spend (`retrieval_server.spend`'s ledger interface) in one Redis hash.

    `reserve` is one RESERVE script: the budget checked against everything committed by every
    replica and the calls added, atomically, so replicas never overspend between them. `settle`
    queues a settlement (an id, the calls it had reserved in Redis, the calls billed) and a
    background task writes the queue with SETTLE, which applies each id once, so a settlement
    resent after a lost reply is not counted twice. While Redis is unreachable a budget fails
    closed (`BudgetUnavailable`); without a budget (price only) calls go on and are counted
    once Redis is back."""

    where = "redis"

    def __init__(self, link: RedisLink, settings: CacheConfig, config: UpstreamConfig) -> None:
        self.link = link
        self.config = config
        identity = str(httpx.URL(config.url).copy_with(userinfo=b"")).encode()
        self.key = f"{settings.redis_namespace}:budget:{hashlib.sha256(identity).hexdigest()[:32]}"
        self.settled_prefix = f"{settings.redis_namespace}:settled:"
        self.known = SpendTotals()  # the fleet's totals as last seen (the seed if Redis lost them)
        self.pending: list[tuple[str, int, int]] = []  # (id, reserved in Redis, billed)
        self.unrecorded = 0  # calls reserved while Redis was unreachable (no budget: allowed)
        self.refusal: str | None = None  # why this Redis may not keep a budget
        self._reserve = link.client.register_script(RESERVE)
        self._settle = link.client.register_script(SETTLE)
        self._flusher: asyncio.Task[None] | None = None
        self._flush_lock = asyncio.Lock()
        link.on_reachable.append(self._on_reachable)

    @property
    def limited(self) -> bool:
        return self.config.limited

    def _seed(self) -> list[Any]:
        k = self.known
        return [k.committed_calls, repr(k.committed_spend), k.calls, repr(k.spent),
                self.config.shown_url]  # fmt: skip

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

    async def refresh(self) -> SpendTotals:
        with contextlib.suppress(SharedUnavailable):
            await self._flush()
            fields = ("committed_calls", "committed_spend", "billed_calls", "billed_spend")
            values = await self.link.call(lambda r: r.hmget(self.key, fields))
            if values[0] is not None:
                self._remember(*values)
        return self.known

    async def verify(self, at_start: bool) -> None:
        """Refuse a Redis that would forget or evict the budget: no append-only file, or an
        allkeys-* eviction policy. At start, one UserError line; later (Redis came back), the
        budget stays closed with the reason. A Redis that does not let INFO be read is
        trusted, with a warning; an unreachable one is checked when it comes back."""
        from redis.exceptions import ResponseError

        try:
            persistence = await self.link.call(lambda r: r.info("persistence"))
            memory = await self.link.call(lambda r: r.info("memory"))
        except SharedUnavailable:
            return
        except ResponseError as err:
            log.warning("redis at %s: INFO refused (%s); its durability is not checked",
                        self.link.shown_url, err)  # fmt: skip
            return
        policy = str(memory.get("maxmemory_policy", "noeviction"))
        problem = None
        if int(persistence.get("aof_enabled", 0)) != 1:
            problem = "does not persist (appendonly no): a restart of Redis would forget the spend"
        elif policy.startswith("allkeys"):
            problem = f"may evict the budget (maxmemory-policy {policy})"
        if problem is None:
            self.refusal = None
            return
        self.refusal = (
            f"redis at {self.link.shown_url} {problem}; run it with appendonly yes and "
            "maxmemory-policy noeviction or volatile-lru to keep the upstream budget there"
        )
        if at_start:
            raise UserError(self.refusal)
        log.error("the upstream budget stays closed: %s", self.refusal)

    async def _on_reachable(self) -> None:
        if self.limited:
            await self.verify(at_start=False)
        self._start_flusher()

    async def reserve(self, calls: int) -> None:
        if self.refusal is not None:
            raise BudgetUnavailable(self.refusal)
        c = self.config
        args = [*self._seed(), calls, repr(c.price_per_call),
                -1 if c.max_calls is None else c.max_calls,
                -1 if c.max_spend is None else repr(c.max_spend)]  # fmt: skip
        try:
            await self._flush()  # what was settled may free budget, and the seed is current
            ok, *totals = await self.link.call(
                lambda r: self._reserve(keys=[self.key], args=args, client=r)
            )
        except SharedUnavailable as err:
            if not self.limited:  # nothing to protect: count it once Redis is back
                self.unrecorded += calls
                return
            raise BudgetUnavailable(
                f"the upstream budget is shared in Redis and {err}; calls are refused until it"
                " is back (cached queries are still answered)"
            ) from None
        known = self._remember(*totals)
        if not ok:
            raise refusal(c, known, calls)

    def settle(self, reserved: int, billed: int) -> None:
        unrecorded = min(self.unrecorded, reserved)
        self.unrecorded -= unrecorded
        self.pending.append((uuid.uuid4().hex, reserved - unrecorded, billed))
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
        if self.pending and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.get_running_loop().create_task(self._flush_until_done())

    async def _flush_until_done(self) -> None:
        while self.pending:
            try:
                await self._flush()
            except SharedUnavailable:
                await asyncio.sleep(self.link.retry_s)

    async def _flush(self) -> None:
        """Write the queued settlements, oldest first; raises SharedUnavailable when Redis
        does not answer (the rest stay queued)."""
        async with self._flush_lock:
            while self.pending:
                op, reserved, billed = self.pending[0]
                price = repr(self.config.price_per_call)
                args = [*self._seed(), reserved, billed, price, SETTLED_KEEP_S]
                keys = [self.key, self.settled_prefix + op]
                totals = await self.link.call(
                    lambda r, k=keys, a=args: self._settle(keys=k, args=a, client=r)
                )
                self.pending.pop(0)
                self._remember(*totals)

    async def close(self) -> None:
        """Write what is queued, if Redis answers (a settlement it never gets leaves its calls
        counted as committed: spent, never unspent)."""
        with contextlib.suppress(SharedUnavailable):
            await self._flush()
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
