"""A rate limit that queues instead of refusing: at most `rate` starts per second, in arrival
order (each caller reserves the next free slot before it sleeps, so concurrent callers never
take the same slot). Used by the emulated API cost and by the calls to an upstream server."""

from __future__ import annotations

import asyncio
import time


class Pacer:
    """Slots `1 / rate` seconds apart; a rate of 0 means no limit."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._next_slot = 0.0  # monotonic time at which the next caller may start

    def reserve(self) -> float:
        """The monotonic time the caller may start at (now, or its queued slot)."""
        now = time.monotonic()
        if self.rate <= 0:
            return now
        slot = max(now, self._next_slot)
        self._next_slot = slot + 1.0 / self.rate
        return slot

    async def wait(self, extra_s: float = 0.0) -> None:
        """Sleep until this caller's slot, plus `extra_s`. uvloop rounds timers to whole
        milliseconds and may wake a little early: sleep again until the deadline, so a caller
        never starts before its slot."""
        deadline = self.reserve() + extra_s
        while (remaining := deadline - time.monotonic()) > 0:
            await asyncio.sleep(remaining)
