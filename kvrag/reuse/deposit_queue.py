"""Deposits made after answers, off the answer's path: one worker thread, within a budget.

An answer that read documents as text ends when its last token is out; the deposit of what it
read (a prefill and a verification) then runs on a worker thread, so neither a streamed answer's
end nor a non-streamed response waits for it. The queue is bounded two ways, so a burst of new
documents cannot pile up work behind the traffic that produced it:

- bytes: the states queued but not yet deposited may come to at most `max_pending_mib` (estimated
  from their token counts); a deposit past that is dropped, and the next reading of those
  documents as text asks again;
- time: a deposit that waited in the queue longer than `max_wait_s` is dropped when its turn comes.

When the process exits, what is queued is still deposited (at most `max_wait_s` more), so a
script that asks one question and ends leaves its state for the next run. Drops are counted
(`stats`) and logged; an answer never depends on a deposit. Chains already
queued are not queued twice, and a chain stored by the time its turn comes costs only reads. A
question whose context is queued or being deposited moves that deposit to the head of the queue
and waits for it (`wait_for`, at most `max_wait_s`) rather than read the same documents again
beside it on the same cores: asked twice in a row, the second answer grafts.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Collection, Sequence

from kvrag.core.schedule import Segment
from kvrag.errors import KVRagError
from kvrag.stores.outages import log_failure

__all__ = ["DepositQueue", "DepositStats"]

log = logging.getLogger("kvrag.deposits")


@dataclass
class DepositStats:
    """What the queue did since it was made."""

    queued: int = 0
    deposited: int = 0
    dropped_for_bytes: int = 0
    dropped_for_time: int = 0
    failed: int = 0


@dataclass(frozen=True)
class _Job:
    deposit: Callable[[Sequence[Segment]], object]
    segments: tuple[Segment, ...]
    missing: tuple[str, ...]  # the keys of the segments not stored when it was queued
    what: str
    bytes: int
    queued_at: float


class DepositQueue:
    """Runs `deposit(segments)` for each submitted chain on one daemon thread, in order. A queue
    made without a `deposit` of its own (a runtime's, shared by the engines over one model) runs
    the one each chain was submitted with."""

    def __init__(self, deposit: Callable[[Sequence[Segment]], object] | None, *, bytes_per_token: int,
                 max_pending_mib: float = 512, max_wait_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if bytes_per_token < 1 or max_pending_mib <= 0 or max_wait_s <= 0:
            raise ValueError("bytes_per_token, max_pending_mib and max_wait_s must be positive")
        self._deposit = deposit
        self.bytes_per_token = bytes_per_token
        self.max_pending_bytes = int(max_pending_mib * 2**20)
        self.max_wait_s = max_wait_s
        self._clock = clock  # what a deposit's time waited in the queue is measured by
        self.stats = DepositStats()
        self._jobs: deque[_Job] = deque()
        self._keys: set[str] = set()  # the last segment's key of every queued or running chain
        self._segments: Counter[str] = Counter()  # every segment key of the queued or running chains
        self._pending_bytes = 0
        self._busy = False
        self._closed = False
        self._lock = threading.Condition()
        self._worker: threading.Thread | None = None

    @property
    def pending_bytes(self) -> int:
        """The estimated bytes of the states queued or being deposited now."""
        with self._lock:
            return self._pending_bytes

    def submit(self, segments: Sequence[Segment], what: str = "the chain", missing: Collection[str] | None = None,
               deposit: Callable[[Sequence[Segment]], object] | None = None) -> bool:
        """Queue `segments` (a chain, in order) for the queue's deposit, or else `deposit`; False when
        it was not queued (nothing to deposit, queued already, or over the byte budget). `missing`: the
        keys of the segments not stored yet (default: all), what `wait_for` waits on and the budget counts."""
        deposit = self._deposit or deposit
        if deposit is None:
            raise ValueError("this queue has no deposit of its own: submit each chain with one")
        if not segments:
            return False
        new = [s for s in segments if missing is None or s.key in missing]
        size = sum(len(s.ids) for s in new) * self.bytes_per_token
        with self._lock:
            if segments[-1].key in self._keys or self._closed:
                return False
            if self._pending_bytes + size > self.max_pending_bytes:
                self.stats.dropped_for_bytes += 1
                log.info("not depositing %s: %d bytes are queued already (budget %d)", what,
                         self._pending_bytes, self.max_pending_bytes)
                return False
            self._jobs.append(_Job(deposit, tuple(segments), tuple(s.key for s in new), what, size, self._clock()))
            self._keys.add(segments[-1].key)
            self._segments.update(s.key for s in new)
            self._pending_bytes += size
            self.stats.queued += 1
            self._start()
            self._lock.notify_all()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued deposit has run; False if `timeout` seconds passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._jobs or self._busy:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def wait_for(self, keys: Sequence[str], timeout: float) -> float:
        """Block while a chain holding one of `keys` is queued or being deposited, at most
        `timeout` seconds; the seconds waited (0.0: none of them was)."""
        began = time.monotonic()
        with self._lock:
            if not any(self._segments[k] > 0 for k in keys):
                return 0.0
            self._promote(set(keys))
            while any(self._segments[k] > 0 for k in keys):
                left = timeout - (time.monotonic() - began)
                if left <= 0:
                    break
                self._lock.wait(left)
        return time.monotonic() - began

    def _promote(self, keys: set[str]) -> None:
        """Move the queued chains holding one of `keys` ahead of the others, in their order: a
        question waiting on one waits for it, not for the queue before it."""
        first = [job for job in self._jobs if keys.intersection(job.missing)]
        if first:
            rest = [job for job in self._jobs if not keys.intersection(job.missing)]
            self._jobs = deque([*first, *rest])

    def close(self, timeout: float | None = None) -> bool:
        """Take no more deposits; wait for those queued (at most `timeout` seconds, default
        `max_wait_s`), then end the worker. False if some were still left."""
        timeout = self.max_wait_s if timeout is None else timeout
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        finished = self.wait(timeout)
        worker = self._worker
        if finished and worker is not None and worker is not threading.current_thread():
            worker.join(timeout)  # a thread still ending (freeing tensors) as the interpreter ends aborts it
        return finished

    def _start(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            if self._worker is None:  # a worker still running torch when the interpreter ends aborts it
                _at_exit(_close_at_exit, weakref.ref(self))
            self._worker = threading.Thread(target=self._run, name="kvrag-deposits", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._jobs:
                    if self._closed:
                        return
                    self._lock.wait()
                job = self._jobs.popleft()
                self._busy = True
            try:
                self._one(job)
            finally:
                with self._lock:
                    self._busy = False
                    self._keys.discard(job.segments[-1].key)
                    self._segments.subtract(job.missing)
                    self._segments += Counter()  # drops the keys counted down to zero
                    self._pending_bytes -= job.bytes
                    self._lock.notify_all()

    def _one(self, job: _Job) -> None:
        waited = self._clock() - job.queued_at
        if waited > self.max_wait_s:
            self.stats.dropped_for_time += 1
            log.info("not depositing %s: it waited %.1f s, past the %.1f s budget", job.what, waited, self.max_wait_s)
            return
        try:
            job.deposit(job.segments)
            self.stats.deposited += 1
        except KVRagError as e:  # the answer stands; the next reading as text asks again
            self.stats.failed += 1
            log_failure(log, "answered, but could not deposit %s afterwards: %s", job.what, e, error=e)
        except Exception:  # a worker outlives any one deposit
            self.stats.failed += 1
            log.exception("answered, but depositing %s afterwards failed", job.what)


def _at_exit(call: Callable[..., None], *args: object) -> None:
    """Run `call` at exit while thread pools still take work (the store reads run on them):
    where threading offers it, before `concurrent.futures` shuts its pools, as its own hook is."""
    register = getattr(threading, "_register_atexit", None)
    try:
        register(call, *args) if register else atexit.register(call, *args)
    except RuntimeError:  # registered while the interpreter is already shutting down
        pass


def _close_at_exit(queue: "weakref.ref[DepositQueue]") -> None:
    alive = queue()
    if alive is not None and not alive.close():
        log.warning("exiting with deposits still queued; they are dropped")
