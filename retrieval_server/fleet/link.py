"""A replica's link to the fleet's Redis (`RedisLink`): every command through one call that
knows whether Redis answers, says in one log line when it stops and comes back, and tells an
outage (`SharedUnavailable`) from an error reply (`SharedRefused`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from retrieval_server.url_secrets import shown_redis_url

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from retrieval_server.serving.cache import CacheConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


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
