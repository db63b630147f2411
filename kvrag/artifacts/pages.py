"""Memory for read buffers kept mapped between reads, so a state read again costs no page faults.

A state read from Redis or disk lands in a fresh buffer of its full size (tens to hundreds of MiB).
Fresh anonymous memory is faulted in page by page as the bytes arrive, and the kernel zeroes every
page first, which costs several times what writing the same bytes into resident pages does. So the
memory of a read buffer is kept: each buffer
maps a region of a memory file (`memfd`) from a small pool, and once the buffer is gone (nothing
holds it, or a tensor or view made from it, any longer) its region serves the next read of a like
size, its pages still resident: mapping them again (`MAP_POPULATE`) costs no faults and no zeroing.

A region is reused only after its last buffer died (a weak reference says so), never shared by two
live buffers, and never across a fork: a region mapped by a live buffer when the process forks is
retired (a child holds that mapping too), and the child closes the parent's regions. The pool holds at most
`DEFAULT_WARM_BYTES` (env `KVRAG_WARM_READ_MIB`; 0 turns it off), least recently used regions
closed first. Reused pages hold an earlier read's bytes until overwritten: a read fills every
byte of its buffer before anything uses it, or it fails and the buffer is dropped.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WarmPages", "DEFAULT_WARM_BYTES", "warm_pages"]

#: the most memory the pool keeps mapped for read buffers, in all
DEFAULT_WARM_BYTES = int(float(os.environ.get("KVRAG_WARM_READ_MIB", "512")) * 2**20)
#: buffers smaller than this take fresh memory (few pages: nothing to save)
MIN_WARM_BYTES = 1 << 20
#: regions are sized in steps of this, so that reads of a like size share them
REGION_STEP = 2 << 20


@dataclass
class _Region:
    fd: int
    capacity: int
    #: the buffer now mapping this region (None, or dead: free)
    user: "weakref.ref[Any] | None" = None
    used_at: float = field(default_factory=time.monotonic)

    @property
    def free(self) -> bool:
        return self.user is None or self.user() is None


class WarmPages:
    """A pool of memory-file regions for read buffers, bounded by `budget` bytes in all."""

    def __init__(self, budget: int = DEFAULT_WARM_BYTES) -> None:
        self.budget = max(0, int(budget))
        self._regions: list[_Region] = []
        self._lock = threading.Lock()

    def map(self, cls: type, size: int) -> Any:
        """A new `cls` (an `mmap.mmap` subclass) of `size` writable bytes over a free region of the
        pool, or None where the pool cannot serve it (too small, over the budget, no memfd here)."""
        if size < MIN_WARM_BYTES or not hasattr(os, "memfd_create"):
            return None
        with self._lock:
            region = self._take(size)
            if region is None:
                return None
            try:
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                buffer = mmap.mmap.__new__(cls, region.fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError):
                self._close(region)
                return None
            region.user, region.used_at = weakref.ref(buffer), time.monotonic()
            return buffer

    def _take(self, size: int) -> _Region | None:
        """The smallest free region that fits `size` without wasting half of itself, else a new one
        (least recently used free regions closed to make room), else None."""
        fits = [r for r in self._regions if r.free and size <= r.capacity < 2 * size]
        if fits:
            return min(fits, key=lambda r: r.capacity)
        capacity = -(-size // REGION_STEP) * REGION_STEP
        if capacity > self.budget:
            return None
        for region in sorted((r for r in self._regions if r.free), key=lambda r: r.used_at):
            if self.held + capacity <= self.budget:
                break
            self._close(region)
        if self.held + capacity > self.budget:
            return None
        try:
            fd = os.memfd_create("kvrag-read", os.MFD_CLOEXEC)
        except OSError:
            return None
        try:
            os.ftruncate(fd, capacity)
        except OSError:
            os.close(fd)
            return None
        region = _Region(fd, capacity)
        self._regions.append(region)
        return region

    def _close(self, region: _Region) -> None:
        self._regions.remove(region)
        os.close(region.fd)  # its pages go once no mapping holds them (a buffer keeps its own)

    @property
    def held(self) -> int:
        """Bytes the pool's regions hold (free or in use)."""
        return sum(r.capacity for r in self._regions)

    def __len__(self) -> int:
        return len(self._regions)


_WARM = WarmPages()


def warm_pages() -> WarmPages:
    """The process's pool (`DEFAULT_WARM_BYTES`)."""
    return _WARM


def _retire_mapped() -> None:
    """Before a fork: a region a live buffer maps is mapped in the child too, so it is never reused."""
    _WARM._lock.acquire()
    for region in [r for r in _WARM._regions if not r.free]:
        _WARM._close(region)


def _after_fork_in_parent() -> None:
    _WARM._lock.release()


def _forget_in_child() -> None:
    for region in _WARM._regions:
        os.close(region.fd)
    _WARM._regions = []
    _WARM._lock = threading.Lock()


os.register_at_fork(before=_retire_mapped, after_in_parent=_after_fork_in_parent, after_in_child=_forget_in_child)
