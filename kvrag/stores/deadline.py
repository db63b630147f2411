"""Bounded waits on stores: one deadline per question, and a breaker per tier.

Every store read an answer makes runs on a worker thread and is waited for only until the
question's deadline; a read still running then is abandoned (the worker finishes or times out on
its own), the tier is reported `unavailable`, and its breaker opens: the tier is skipped for a
cool-down, so the next questions do not wait on it again; a tier with a liveness probe is probed
twice a second meanwhile and used again as soon as it answers.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import lru_cache
from typing import Callable, TypeVar

from kvrag.errors import StoreUnavailableError

__all__ = ["Deadline", "Breaker", "DEFAULT_DEADLINE_S", "BREAKER_COOLDOWN_S", "BREAKER_PROBE_S", "bounded"]

T = TypeVar("T")

DEFAULT_DEADLINE_S = float(os.environ.get("KVRAG_DEADLINE_S", "5"))
BREAKER_COOLDOWN_S = float(os.environ.get("KVRAG_BREAKER_COOLDOWN_S", "30"))
#: how often an open breaker with a probe checks whether its tier is back
BREAKER_PROBE_S = float(os.environ.get("KVRAG_BREAKER_PROBE_S", "0.5"))


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
    """Open after a tier timed out or failed to connect: the tier is skipped until the cool-down ends.

    With a `probe` (a cheap, short-timeout liveness check the tier supplies, e.g. a Redis PING), the
    breaker is half-open: at most once per `probe_interval_s` the next caller runs the probe, and
    if it passes the breaker closes at once, so a restarted server is used again within about
    that interval instead of after the whole cool-down."""

    def __init__(self, cooldown_s: float = BREAKER_COOLDOWN_S, *, probe: Callable[[], bool] | None = None,
                 probe_interval_s: float = BREAKER_PROBE_S) -> None:
        self.cooldown_s = cooldown_s
        self.probe = probe
        self.probe_interval_s = probe_interval_s
        self.open_until = 0.0
        self.next_probe = 0.0
        self.why = ""
        self._probing = threading.Lock()

    @property
    def is_open(self) -> bool:
        now = time.monotonic()
        if now >= self.open_until:
            return False
        if self.probe is None or now < self.next_probe or not self._probing.acquire(blocking=False):
            return True
        try:
            self.next_probe = now + self.probe_interval_s
            try:
                alive = bool(self.probe())
            except Exception:  # noqa: BLE001 - any failure of the probe means: still down
                alive = False
            if alive:
                self.close()
            return not alive
        finally:
            self._probing.release()

    def trip(self, why: str) -> None:
        now = time.monotonic()
        self.open_until, self.next_probe, self.why = now + self.cooldown_s, now + self.probe_interval_s, why

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
