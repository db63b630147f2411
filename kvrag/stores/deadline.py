"""Bounded waits on stores: one deadline per question, and a breaker per tier.

Every store read an answer makes runs on a worker thread and is waited for only until the
question's deadline; a read still running then is abandoned (the worker finishes or times out on
its own), the tier is reported `unavailable`, and its breaker opens: the tier is skipped for a
cool-down, so the next questions do not wait on it again.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import lru_cache
from typing import Callable, TypeVar

from kvrag.errors import StoreUnavailableError

__all__ = ["Deadline", "Breaker", "DEFAULT_DEADLINE_S", "BREAKER_COOLDOWN_S", "bounded"]

T = TypeVar("T")

DEFAULT_DEADLINE_S = float(os.environ.get("KVRAG_DEADLINE_S", "5"))
BREAKER_COOLDOWN_S = float(os.environ.get("KVRAG_BREAKER_COOLDOWN_S", "30"))


class Deadline:
    """A budget of seconds for every store read of one question, counted from the first read."""

    def __init__(self, seconds: float = DEFAULT_DEADLINE_S) -> None:
        self.seconds = seconds
        self.end: float | None = None

    def remaining(self) -> float:
        if self.end is None:
            self.end = time.monotonic() + self.seconds
        return max(0.0, self.end - time.monotonic())

    @property
    def expired(self) -> bool:
        return self.remaining() <= 0


class Breaker:
    """Open after a tier timed out or failed to connect: the tier is skipped until the cool-down ends."""

    def __init__(self, cooldown_s: float = BREAKER_COOLDOWN_S) -> None:
        self.cooldown_s = cooldown_s
        self.open_until = 0.0
        self.why = ""

    @property
    def is_open(self) -> bool:
        return time.monotonic() < self.open_until

    def trip(self, why: str) -> None:
        self.open_until, self.why = time.monotonic() + self.cooldown_s, why

    def close(self) -> None:
        self.open_until = 0.0


@lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvrag-store")


def bounded(fn: Callable[[], T], deadline: Deadline | None, what: str) -> T:
    """`fn()`, waited for until `deadline` (no deadline: called here, unbounded)."""
    if deadline is None:
        return fn()
    if deadline.expired:
        raise StoreUnavailableError(f"{what}: the question's {deadline.seconds:g} s for store reads was spent")
    future = _pool().submit(fn)
    try:
        return future.result(timeout=deadline.remaining())
    except FutureTimeout:
        future.cancel()
        raise StoreUnavailableError(f"{what}: no answer within the question's {deadline.seconds:g} s deadline") from None
