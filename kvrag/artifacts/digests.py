"""Chunked SHA-256 digests: integrity checks that run on both cores.

A payload is checked as fixed-size chunks, each with its own SHA-256, hashed in parallel threads
(hashlib releases the GIL on large buffers). A manifest commits to its chunk digests, so a remote
tier whose frames have the same size can check them while fetching, and hand over a buffer that
records which digests it already checked; nothing is hashed twice.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence

__all__ = ["CHUNK_BYTES", "PayloadLayout", "chunk_digests", "CheckedBuffer", "hash_pool", "read_checked"]

CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class PayloadLayout:
    """How a payload is cut and what each chunk's SHA-256 must be, as signed data says: a reader
    allocates `size` bytes and checks each chunk against `chunks` as it arrives."""

    size: int
    chunk_bytes: int
    chunks: Sequence[str]


@lru_cache(maxsize=1)
def hash_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="kvrag-sha256")


def chunk_digests(data: Any, chunk_bytes: int = CHUNK_BYTES) -> list[str]:
    view = memoryview(data).cast("B")
    chunks = [view[i : i + chunk_bytes] for i in range(0, len(view), chunk_bytes)]
    if len(chunks) <= 1:
        return [hashlib.sha256(c).hexdigest() for c in chunks]
    return list(hash_pool().map(lambda c: hashlib.sha256(c).hexdigest(), chunks))


class CheckedBuffer(mmap.mmap):
    """A fresh, writable buffer for payload bytes; once a store has checked its chunks, it records
    against which digests (`chunk_bytes`, `chunk_digests`), so nothing is hashed twice.

    It is anonymous memory mapped for the purpose: filled by `readinto` it measured faster here
    than a fresh `bytearray` (whose memory is faulted in page by page as it is first written).
    Advising it for transparent huge pages was faster still in a fresh process, and much slower
    in a long-running one (the kernel compacts memory to find huge pages), so it is not."""

    chunk_bytes: int = 0
    chunk_digests: Sequence[str] = ()

    def __new__(cls, size: int) -> "CheckedBuffer":
        buffer = super().__new__(cls, -1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buffer.size_ = size
        return buffer

    def __len__(self) -> int:
        return self.size_

    def view(self) -> memoryview:
        """The buffer's bytes (a zero-length buffer maps one byte it never shows)."""
        return memoryview(self)[: self.size_]


def read_checked(readinto: Callable[[memoryview], int], size: int, chunk_bytes: int,
                 digests: Sequence[str]) -> CheckedBuffer | None:
    """`size` bytes read chunk by chunk into one buffer, each chunk hashed on the pool while the
    next is read. None if a read comes up short or a chunk's SHA-256 is not its digest."""
    if -(-size // chunk_bytes) != len(digests):
        return None
    buffer = CheckedBuffer(size)
    view = buffer.view()
    checks = []
    for index, start in enumerate(range(0, size, chunk_bytes)):
        chunk = view[start : start + chunk_bytes]
        if readinto(chunk) != len(chunk):
            return None
        checks.append(hash_pool().submit(lambda c=chunk, d=digests[index]: hashlib.sha256(c).hexdigest() == d))
    if not all(check.result() for check in checks):
        return None
    buffer.chunk_bytes, buffer.chunk_digests = chunk_bytes, list(digests)
    return buffer
