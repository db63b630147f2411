"""Admission: at most `concurrency` generations at once and `queue` waiting per worker; the rest
are refused with 429 and a `Retry-After` estimated from recent durations, instead of letting
latency grow without bound."""

from __future__ import annotations

import asyncio
import math
from collections import deque

from kvrag.server import metrics
from kvrag.server.protocol import ApiError

__all__ = ["Admission"]


class Admission:
    """The generation slots of one worker and the requests waiting for one."""

    def __init__(self, concurrency: int, queue: int) -> None:
        self.concurrency, self.queue = concurrency, queue
        self._slots = asyncio.Semaphore(concurrency)
        self.waiting = self.running = 0
        self._durations: deque[float] = deque(maxlen=32)

    async def acquire(self) -> None:
        if self._slots.locked() and self.waiting >= self.queue:
            metrics.REJECTED.labels("queue-full").inc()
            raise ApiError(429, f"all {self.concurrency} generation slots are busy and {self.queue} requests are "
                           "waiting; retry after the time in Retry-After", type="requests", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.retry_after())})
        self.waiting += 1
        metrics.QUEUED.inc()
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
            metrics.QUEUED.dec()
        self.running += 1
        metrics.IN_FLIGHT.inc()

    def release(self, seconds: float) -> None:
        self._durations.append(seconds)
        self.running -= 1
        metrics.IN_FLIGHT.dec()
        self._slots.release()

    def retry_after(self) -> int:
        typical = sorted(self._durations)[len(self._durations) // 2] if self._durations else 1.0
        return max(1, math.ceil(typical * (self.waiting + 1) / self.concurrency))
