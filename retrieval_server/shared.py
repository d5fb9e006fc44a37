"""One cache and one budget for a fleet of `hdr serve` replicas, on Redis (`cache.backend: redis`).

Each replica keeps its own cache (`retrieval_server.cache.ResultCache`) in front; behind it, in
one Redis (a single server, or a primary with its replicas; not Redis Cluster, whose keys of
one script must share a slot):

- answers, `NS:answer:FINGERPRINT:SHA256(key)`: the answer's bytes, written by the replica that
  computed (or paid for) it, with an expiry (`cache.ttl_s`, else `cache.redis_ttl_s`), so a miss
  of one replica is a hit on every other, byte for byte. An answer read from Redis is checked
  (a list of documents, with scores where asked) before it is served or cached; anything else
  is computed again and written over. FINGERPRINT is the replica's own (its
  index and the settings that decide answers, or its upstream's description), so replicas of
  different indexes never share an answer;
- locks, `NS:lock:FINGERPRINT:SHA256(key)`: set if absent (with an expiry, `cache.redis_lock_s`,
  renewed while the holder lives), in the same step that finds no answer (CLAIM), by the
  replica that computes a query, and deleted by that holder alone when it writes the answer or
  gives up. A replica that finds a query locked waits for
  its answer (polling, 2 ms growing to 50 ms); when the lock goes without an answer (its
  holder failed, or died and the lock expired) it takes the query over. So identical queries
  in flight on several replicas are computed once;
- the budget of proxy mode, `NS:budget:SHA256(upstream identity)`: `RedisLedger`, one hash for
  the fleet, checked and spent in one step. The identity is the URL normalised
  (`upstream_identity`: host case, default port, `localhost` and `127.0.0.1` alike), so
  replicas that spell one upstream differently share one budget. It carries the id it was
  created with, which each replica keeps in its record (`upstream.spend_path`): a budget
  that Redis loses (restarted empty, flushed, evicted) is never refilled from what a replica
  last saw or from zero; reservations are refused in one line until Redis's data is
  restored.

Every check-and-change is a Lua script (redis-py's `register_script`), so it is atomic. Redis
commands are not retried by the client: a reservation sent twice would spend twice.

Redis unreachable (a refused connection, or no answer within `cache.redis_timeout_s`): the
replica says so in one log line and in /health, serves from its own cache and its own searches
(as `cache.backend: memory` would; what it computes meanwhile is written to Redis once Redis is
back, as far as its own cache still holds it: the answers waiting stay inside
`cache.max_bytes`), and tries Redis again after `cache.redis_retry_s`. A budget
kept in Redis fails closed meanwhile: reservations are refused (misses answered 503, cached
queries still served), and the settlements of calls already sent wait in memory, each
numbered so that it counts once, until Redis is back. A budget is only kept in a Redis that
persists (append-only file on) and never evicts it (`maxmemory-policy` volatile-*: answers
expire and are evicted, the budget does not; or noeviction without a `maxmemory`, which would
fill with answers and then refuse the budget's updates): `hdr serve` refuses any other at
start. An error reply (out of memory, a read-only replica) is not an outage: Redis is
reachable, the command did nothing; the replica says so in one log line for each new reply,
an answer it could not write stays in its own cache, and a reservation it could not make is
a 503 naming the reply. A replica's settlements are numbered, and Redis keeps one key per
replica with the last number applied, so a settlement resent after a lost reply counts once.
Each reservation is numbered too and kept open under its replica until settled
(`NS:replica:DIGEST:open:TOKEN`): one whose reply was lost (a timeout after Redis ran it) is
released once Redis answers again, and a replica whose liveness key (`...:alive:TOKEN`,
renewed while it runs, expiring after `cache.redis_lock_s`) is gone with reservations open is
found by the next replica that starts or renews: one log line, and its calls stay counted as
spent (the upstream may have billed them), as a spend file counts a crashed server's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import ipaddress
import logging
import secrets
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import httpx
import orjson
from pydantic import BaseModel, TypeAdapter, ValidationError

from core.errors import UserError
from retrieval_server.api import Document
from retrieval_server.cache import CacheKey, ResultCache
from retrieval_server.upstream.spend import BudgetUnavailable, FleetRecord, SpendTotals, refusal
from retrieval_server.url_secrets import shown_redis_url

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from retrieval_server.cache import CacheConfig
    from retrieval_server.upstream.config import UpstreamConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
FIRST_POLL_S, LAST_POLL_S = 0.002, 0.05  # a waiter's polls for another replica's answer
SETTLED_KEEP_S = 86400  # how long a replica's last settlement number is kept after its last
UNPUBLISHED_KEEP = 10_000  # keys of answers to write once Redis is back (the oldest go first)

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
# The budget hash: budget_id (made when the budget was created), upstream, committed_calls /
# committed_spend (billed, reserved and unsettled: what the budget counts) and billed_calls /
# billed_spend. Only INIT creates it, and only where the replica's record knows of no budget:
# a hash that is gone is reported ('missing') by every other script, never refilled.
BUDGET_PRELUDE = """
local function check(key, id)
  local v = redis.call('HMGET', key, 'budget_id', 'committed_calls', 'committed_spend',
                       'billed_calls', 'billed_spend')
  if not v[1] then
    if redis.call('EXISTS', key) == 0 then return 'missing' end
    return 'damaged budget_id'
  end
  if v[1] ~= id then return 'other ' .. v[1] end
  local names = {'committed_calls', 'committed_spend', 'billed_calls', 'billed_spend'}
  for i = 2, 5 do
    local n = tonumber(v[i])
    if n == nil or n ~= n or n < 0 or n == math.huge
       or ((i == 2 or i == 4) and not string.match(v[i], '^%d+$')) then
      return 'damaged ' .. names[i - 1]
    end
  end
  return nil
end
local function totals(key)
  return redis.call('HMGET', key, 'committed_calls', 'committed_spend', 'billed_calls',
                    'billed_spend')
end
"""
# KEYS: budget, its key before upstream identities were normalised; ARGV: a new id, the
# upstream (shown), the id this replica's record knows ('': none) -> the budget's id, or nil
# when the record knows one and the hash is gone (lost)
INIT = """
if KEYS[2] ~= KEYS[1] and redis.call('EXISTS', KEYS[1]) == 0
   and redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('RENAME', KEYS[2], KEYS[1])
end
local id = redis.call('HGET', KEYS[1], 'budget_id')
if id then return id end
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'budget_id', ARGV[1])
  return ARGV[1]
end
if ARGV[3] ~= '' then return false end
redis.call('HSET', KEYS[1], 'budget_id', ARGV[1], 'upstream', ARGV[2], 'committed_calls', 0,
           'committed_spend', 0, 'billed_calls', 0, 'billed_spend', 0)
return ARGV[1]
"""
# KEYS: budget, this replica's open reservations, its liveness, the budget's replicas; ARGV:
# budget id, calls, price, max_calls (-1: none), max_spend (-1: none), the reservation's
# number, this replica's token, liveness expiry (ms) -> {1 or 0 (refused), totals...}, or
# {problem}
RESERVE = (
    BUDGET_PRELUDE
    + """
local problem = check(KEYS[1], ARGV[1])
if problem then return {problem} end
local t = totals(KEYS[1])
local calls, price = tonumber(ARGV[2]), tonumber(ARGV[3])
local max_calls, max_spend = tonumber(ARGV[4]), tonumber(ARGV[5])
local ok = 1
if max_calls >= 0 and tonumber(t[1]) + calls > max_calls then ok = 0 end
if ok == 1 and max_spend >= 0 and price > 0
   and calls > math.floor((max_spend - tonumber(t[2])) / price + 1e-9) then ok = 0 end
if ok == 1 then
  redis.call('HINCRBY', KEYS[1], 'committed_calls', calls)
  redis.call('HINCRBYFLOAT', KEYS[1], 'committed_spend', calls * price)
  redis.call('HSET', KEYS[2], ARGV[6], calls)
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[8])
  redis.call('SADD', KEYS[4], ARGV[7])
  t = totals(KEYS[1])
end
return {ok, t[1], t[2], t[3], t[4]}
"""
)
# KEYS: budget, this replica's last applied settlement number, its open reservations; ARGV:
# budget id, reserved (in Redis), billed, price, how long the number is kept (s), the
# settlement's number (a replica settles in order, one at a time), then pairs (reservation
# number, calls of it still open) -> {1, totals...}, or {problem} (not applied)
SETTLE = (
    BUDGET_PRELUDE
    + """
local problem = check(KEYS[1], ARGV[1])
if problem then return {problem} end
local reserved, billed, price = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if tonumber(ARGV[6]) > tonumber(redis.call('GET', KEYS[2]) or '0') then
  redis.call('SET', KEYS[2], ARGV[6], 'EX', ARGV[5])
  if billed ~= reserved then
    redis.call('HINCRBY', KEYS[1], 'committed_calls', billed - reserved)
    redis.call('HINCRBYFLOAT', KEYS[1], 'committed_spend', (billed - reserved) * price)
  end
  if billed > 0 then
    redis.call('HINCRBY', KEYS[1], 'billed_calls', billed)
    redis.call('HINCRBYFLOAT', KEYS[1], 'billed_spend', billed * price)
  end
  for i = 7, #ARGV, 2 do
    if tonumber(ARGV[i + 1]) > 0 then
      redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
    else
      redis.call('HDEL', KEYS[3], ARGV[i])
    end
  end
end
local t = totals(KEYS[1])
return {1, t[1], t[2], t[3], t[4]}
"""
)


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


# KEYS: budget, this replica's open reservations; ARGV: budget id, a reservation's number,
# price -> {1, totals...}, or {problem}. Releases a reservation whose reply was lost, if it
# was made (once: its record goes with it)
CANCEL = (
    BUDGET_PRELUDE
    + """
local problem = check(KEYS[1], ARGV[1])
if problem then return {problem} end
local calls = tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '0')
if calls > 0 then
  redis.call('HINCRBY', KEYS[1], 'committed_calls', -calls)
  redis.call('HINCRBYFLOAT', KEYS[1], 'committed_spend', -calls * tonumber(ARGV[3]))
  redis.call('HDEL', KEYS[2], ARGV[2])
end
local t = totals(KEYS[1])
return {1, t[1], t[2], t[3], t[4]}
"""
)
# KEYS: budget, the budget's replicas; ARGV: the prefix of a replica's keys (PREFIX..'open:'..
# token, PREFIX..'alive:'..token) -> {token, calls, ...} of the replicas whose liveness
# expired with reservations open: those stay committed (the upstream may have billed them),
# are added to unsettled_calls, and their records go
REAP = """
local out = {}
for _, token in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if redis.call('EXISTS', ARGV[1] .. 'alive:' .. token) == 0 then
    local open = ARGV[1] .. 'open:' .. token
    local calls = 0
    for _, value in ipairs(redis.call('HVALS', open)) do calls = calls + tonumber(value) end
    redis.call('DEL', open)
    redis.call('SREM', KEYS[2], token)
    if calls > 0 and redis.call('EXISTS', KEYS[1]) == 1 then
      redis.call('HINCRBY', KEYS[1], 'unsettled_calls', calls)
      out[#out + 1] = token
      out[#out + 1] = calls
    end
  end
end
return out
"""


class SharedScored(BaseModel):
    """One ranked document of an answer with scores (a score that was not finite is null)."""

    document: Document
    score: float | None


# what an answer read from Redis must be, as hdr's client reads it
SHARED_SCORED = TypeAdapter(list[SharedScored])
SHARED_PLAIN = TypeAdapter(list[Document])


class SharedUnavailable(Exception):
    """Redis did not answer (or is waited out after a failure); the detail says why."""


class SharedRefused(SharedUnavailable):
    """Redis answered a command with an error (out of memory under noeviction, a read-only
    replica, a command renamed away): Redis is reachable, the command did nothing."""


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
        self.last_error: str | None = None  # Redis's last error reply (logged once each)
        self.consequence_of_errors = (
            "the command is not retried; this replica goes on without it"
            " (its answers are not shared, a reservation it refused is refused)"
        )
        self.down_since: float | None = None  # unix time
        self._retry_at = 0.0
        self.on_reachable: list[Callable[[], Awaitable[None]]] = []  # run when Redis is back

    async def call(self, operation: Callable[[Redis], Awaitable[T]]) -> T:
        from redis.exceptions import RedisError, ResponseError

        if not self.reachable and time.monotonic() < self._retry_at:
            raise SharedUnavailable(self.reason)
        try:
            result = await operation(self.client)
        except ResponseError as err:  # Redis answered, with an error: not an outage
            if not self.reachable:
                self._back()
            raise self._refused(err) from None
        except (RedisError, OSError, asyncio.TimeoutError) as err:
            self._unreachable(err)
            raise SharedUnavailable(self.reason) from None
        if not self.reachable:
            self._back()
        return result

    def will_send(self) -> bool:
        """Whether a call now goes to Redis (not failed at once, Redis being waited out)."""
        return self.reachable or time.monotonic() >= self._retry_at

    def _refused(self, err: Exception) -> SharedRefused:
        """The error reply as one line, logged once for each new reply (not per command)."""
        # the reply without the script's name and line (which would make each script's new)
        reply = " ".join(str(err).split(" script: ")[0].split()).rstrip(".")[:200]
        reply = reply if type(err).__name__ == "ResponseError" else f"{type(err).__name__}: {reply}"
        refused = SharedRefused(f"redis at {self.shown_url} answered an error ({reply})")
        if reply != self.last_error:
            self.last_error = reply
            log.warning("%s: %s", refused, self.consequence_of_errors)
        return refused

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

    def __init__(
        self, link: RedisLink, settings: CacheConfig, fingerprint: str, local: ResultCache
    ) -> None:
        self.link = link
        self.local = local  # this replica's cache, in front
        self.prefix = f"{settings.redis_namespace}:%s:{fingerprint}:"
        self.lock_ms = int(settings.redis_lock_s * 1000)
        self.answer_ms = int((settings.ttl_s or settings.redis_ttl_s) * 1000)
        self.token = secrets.token_hex(16)  # this replica's, in every lock it holds
        self.held: dict[str, int] = {}  # lock key -> this replica's leaders holding it
        self.took_over = 0  # queries computed here after their lock went without an answer
        self.rejected = 0  # answers read from Redis that were not answers (computed again)
        # the keys of answers computed while Redis did not answer: written when it is back, so
        # another replica does not pay for them again. Only the keys wait: the answers are
        # this replica's cache's own (read from it then), so they stay inside cache.max_bytes,
        # and one the cache evicted meanwhile is not written
        self.unpublished: dict[CacheKey, None] = {}
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
        except SharedRefused:  # no lock can be written (out of memory): answers still read
            return await self._read_only(keys, names)
        except SharedUnavailable:
            return {}, list(keys), []
        answered, mine, theirs = {}, [], []
        for key, lock, reply in zip(keys, names[1::2], replies, strict=True):
            if isinstance(reply, bytes) and self.valid(key, reply):
                answered[key] = reply
            elif isinstance(reply, bytes):  # computed here, and its answer written over it
                mine.append(key)
            elif reply == 1:
                mine.append(key)
                self.held[lock] = self.held.get(lock, 0) + 1
            else:
                theirs.append(key)
        if mine and (self._renewer is None or self._renewer.done()):
            self._renewer = asyncio.get_running_loop().create_task(self._renew_held())
        return answered, mine, theirs

    async def _read_only(
        self, keys: list[CacheKey], names: list[str]
    ) -> tuple[dict[CacheKey, bytes], list[CacheKey], list[CacheKey]]:
        """`claim` where Redis refuses writes: the answers it holds, every other key computed
        here without a lock."""
        try:
            replies = await self.link.call(lambda r: self._peek(keys=names, client=r))
        except SharedUnavailable:
            return {}, list(keys), []
        answered = {
            key: reply
            for key, reply in zip(keys, replies, strict=True)
            if isinstance(reply, bytes) and self.valid(key, reply)
        }
        return answered, [key for key in keys if key not in answered], []

    def valid(self, key: CacheKey, answer: bytes) -> bool:
        """Whether an answer read from Redis is one query's answer as a client reads it (the
        documents, with scores where the key asks for them); another is never served, and
        the replica computes the query and writes its answer over it (one log line a
        replica)."""
        try:
            (SHARED_SCORED if key.return_scores else SHARED_PLAIN).validate_json(answer)
            return True
        except ValidationError:
            self.rejected += 1
            if self.rejected == 1:
                log.warning(
                    "redis at %s holds an answer that is not a list of documents (%d bytes at"
                    " an answer of fingerprint %s): not served; computed again and written"
                    " over it (said once)",
                    self.link.shown_url,
                    len(answer),
                    self.prefix.split(":")[-2],
                )
            return False

    def _let_go(self, locks: list[str]) -> None:
        for lock in locks:
            if self.held.get(lock, 0) <= 1:
                self.held.pop(lock, None)
            else:
                self.held[lock] -= 1

    async def store(self, answers: dict[CacheKey, bytes]) -> None:
        """Write the answers this replica computed and release their locks; while Redis does
        not answer their keys wait (at most UNPUBLISHED_KEEP) until it is back."""
        names = [name for key in answers for name in self._names(key)]
        self._let_go(names[1::2])
        try:
            await self._write(names, list(answers.values()))
        except SharedRefused:
            return  # Redis answered and refused: the answer stays in this replica's cache
        except SharedUnavailable:
            self.unpublished.update(dict.fromkeys(answers))
            if len(self.unpublished) > 2 * len(self.local) + 64:  # forget what the cache let go
                self.unpublished = {
                    key: None for key in self.unpublished if self.local.peek(key) is not None
                } | dict.fromkeys(answers)
            while len(self.unpublished) > UNPUBLISHED_KEEP:
                self.unpublished.pop(next(iter(self.unpublished)))

    async def _write(self, names: list[str], values: list[bytes]) -> None:
        args = [self.token, self.answer_ms, *values]
        await self.link.call(lambda r: self._publish(keys=names, args=args, client=r))

    async def _publish_the_unpublished(self) -> None:
        waiting, self.unpublished = self.unpublished, {}
        held = {key: value for key in waiting if (value := self.local.peek(key)) is not None}
        if held:
            names = [name for key in held for name in self._names(key)]
            try:
                await self._write(names, list(held.values()))
            except SharedRefused:
                pass  # Redis answered and refused them: they stay in this replica's cache
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
                if isinstance(reply, bytes) and self.valid(key, reply):
                    got[key] = reply
                elif isinstance(reply, bytes):
                    orphaned.append(key)
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
