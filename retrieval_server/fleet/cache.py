"""The fleet's answers and locks in Redis (`SharedCache`, behind each replica's own cache): one
CLAIM step finds an answer or takes the query's lock, so identical queries in flight on
several replicas are computed once (the package's docstring has the keys and the outage)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
from typing import TYPE_CHECKING

import orjson
from pydantic import BaseModel, TypeAdapter, ValidationError

from retrieval_server.api import Document
from retrieval_server.fleet.link import RedisLink, SharedRefused, SharedUnavailable
from retrieval_server.serving.cache import CacheKey, ResultCache

if TYPE_CHECKING:
    from retrieval_server.serving.cache import CacheConfig

log = logging.getLogger(__name__)
FIRST_POLL_S, LAST_POLL_S = 0.002, 0.05  # a waiter's polls for another replica's answer
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


class SharedScored(BaseModel):
    """One ranked document of an answer with scores (a score that was not finite is null)."""

    document: Document
    score: float | None


# what an answer read from Redis must be, as hdr's client reads it
SHARED_SCORED = TypeAdapter(list[SharedScored])
SHARED_PLAIN = TypeAdapter(list[Document])


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
