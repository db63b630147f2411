"""Bounded waits on stores: one deadline per question, and a breaker per tier.

Every store read an answer makes runs on a worker thread and is waited for only until the
question's deadline; a read still running then is abandoned (the worker finishes or times out on
its own), the tier is reported `unavailable`, and its breaker opens: the tier is skipped for a
cool-down, so the next questions do not wait on it again; a tier with a liveness probe is probed
twice a second meanwhile (off the caller's path) and used again as soon as it answers.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import lru_cache
from typing import Callable, TypeVar

from kvrag.errors import StoreTimeoutError
from kvrag.stores import outages

__all__ = ["Deadline", "Breaker", "DEFAULT_DEADLINE_S", "BREAKER_COOLDOWN_S", "BREAKER_PROBE_S", "BREAKER_PROBE_WAIT_S",
           "bounded", "submit_read"]

T = TypeVar("T")

DEFAULT_DEADLINE_S = float(os.environ.get("KVRAG_DEADLINE_S", "5"))
BREAKER_COOLDOWN_S = float(os.environ.get("KVRAG_BREAKER_COOLDOWN_S", "30"))
#: how often an open breaker with a probe checks whether its tier is back
BREAKER_PROBE_S = float(os.environ.get("KVRAG_BREAKER_PROBE_S", "0.5"))
#: how long a caller waits for a probe it started (a live server answers a PING in about a millisecond)
BREAKER_PROBE_WAIT_S = float(os.environ.get("KVRAG_BREAKER_PROBE_WAIT_S", "0.1"))


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

    With a `probe` (a cheap liveness check the tier supplies, e.g. a Redis PING on a connection of
    its own), the breaker is half-open: at most once per `probe_interval_s` a caller starts the probe
    on a thread of its own and waits for it at most `probe_wait_s`; if it passes the breaker closes,
    so a restarted server is used again within about that interval instead of after the whole
    cool-down. A slow probe never holds a caller longer than that wait (it finishes on its own)."""

    def __init__(self, cooldown_s: float = BREAKER_COOLDOWN_S, *, probe: Callable[[], bool] | None = None,
                 probe_interval_s: float = BREAKER_PROBE_S, probe_wait_s: float = BREAKER_PROBE_WAIT_S,
                 name: str = "") -> None:
        #: the tier's URL: a trip reports its outage (once), a probe that passes its return
        self.name = name
        self.cooldown_s = cooldown_s
        self.probe = probe
        self.probe_interval_s = probe_interval_s
        self.probe_wait_s = probe_wait_s
        self.open_until = 0.0
        self.next_probe = 0.0
        self.why = ""
        #: what the last probe that failed said (for diagnosis: logs, `repr`)
        self.probe_failure = ""
        self._probing = threading.Lock()

    @property
    def is_open(self) -> bool:
        now = time.monotonic()
        if now >= self.open_until:
            return False
        if self.probe is None or now < self.next_probe or not self._probing.acquire(blocking=False):
            return True
        self.next_probe = now + self.probe_interval_s
        done = threading.Event()
        try:
            threading.Thread(target=self._run_probe, args=(done,), name="kvrag-breaker-probe", daemon=True).start()
        except RuntimeError as e:  # no thread to be had now: still open, and the next interval probes again
            self.probe_failure = f"the probe could not start: {e}"
            self._probing.release()
            return True
        done.wait(self.probe_wait_s)
        return time.monotonic() < self.open_until

    def _run_probe(self, done: threading.Event) -> None:
        try:
            if self.probe():  # type: ignore[misc]
                self.close()
            else:
                self.probe_failure = "the probe was answered, but not as a live server answers"
        except Exception as e:  # noqa: BLE001 - any failure of the probe means: still down
            self.probe_failure = f"{type(e).__name__}: {e}"
        finally:
            self._probing.release()
            done.set()

    def trip(self, why: str) -> None:
        now = time.monotonic()
        self.open_until, self.next_probe, self.why = now + self.cooldown_s, now + self.probe_interval_s, why
        if self.name:
            outages.went_down(self.name, why)

    def close(self) -> None:
        self.open_until = 0.0
        if self.name:
            outages.answered(self.name)

    def __repr__(self) -> str:
        state = "closed" if time.monotonic() >= self.open_until else f"open ({self.why})"
        return f"Breaker({state}; last probe failure: {self.probe_failure or 'none'})"


class _Workers:
    """Threads for bounded reads. A read past its deadline is abandoned, not stopped (it ends with
    its socket's timeout), so a pool of fixed size could fill with abandoned reads of a stalled
    tier and make a healthy tier's reads queue behind them: when every pooled worker is busy, a
    read gets a thread of its own instead of a place in a queue."""

    def __init__(self, pooled: int = 16) -> None:
        self.pooled = pooled
        self._pool = ThreadPoolExecutor(max_workers=pooled, thread_name_prefix="kvrag-store")
        self._busy = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        with self._lock:
            pooled = self._busy < self.pooled
            if pooled:
                self._busy += 1
        if pooled:
            return self._pool.submit(self._counted, fn)
        future: Future[T] = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                    future.set_exception(e)

        threading.Thread(target=run, name="kvrag-store-extra", daemon=True).start()
        return future

    def _counted(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        finally:
            with self._lock:
                self._busy -= 1


@lru_cache(maxsize=1)
def _workers() -> _Workers:
    return _Workers()


def submit_read(fn: Callable[[], T]) -> "Future[T]":
    """`fn()` on a store-read thread at once, never queued behind other reads (see `_Workers`)."""
    return _workers().submit(fn)


def bounded(fn: Callable[[], T], deadline: Deadline | None, what: str) -> T:
    """`fn()`, waited for until `deadline` (no deadline: called here, unbounded)."""
    if deadline is None:
        return fn()
    if deadline.expired:
        raise StoreTimeoutError(f"{what}: the question's {deadline.seconds:g} s for store reads was spent")
    future = submit_read(fn)
    try:
        return future.result(timeout=deadline.remaining())
    except FutureTimeout:
        future.cancel()
        raise StoreTimeoutError(f"{what}: no answer within the question's {deadline.seconds:g} s deadline") from None
