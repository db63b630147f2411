"""Chunked payload checks that run on both cores, while the next chunk is still being read.

A payload is stored as fixed-size chunks. A manifest commits to each chunk's SHA-256 (the record
of what was stored) and, in states written since, to a faster per-read check: a keyed tag, or the
tag of an AEAD that also keeps the chunk confidential (see `kvrag.artifacts.payloads`). A reader checks
each chunk with the chunking's `ChunkOpener` on the hashing threads (hashlib, BLAKE3 and OpenSSL
release the GIL on large buffers) while the next one is on the wire, and hands over a buffer that
records what checked it; nothing is checked twice.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence

from kvrag.artifacts.pages import warm_pages

__all__ = ["CHUNK_BYTES", "LEGACY_CHUNK_BYTES", "PayloadChunking", "ChunkOpener", "Sha256Chunks", "chunk_digests", "CheckedBuffer", "HeldBytes",
           "hash_pool", "spans", "read_checked", "open_payload", "stored_form"]

#: the chunk size of states written now: one Redis frame per chunk. Redis copies each reply into a
#: fresh allocation, cheap while it stays in jemalloc's small-extent cache, and 64 bytes under 2 MiB
#: the value and its header fit its 2 MiB size class
CHUNK_BYTES = (2 << 20) - 64
#: the chunk size of a manifest that names none
LEGACY_CHUNK_BYTES = 8 << 20


class ChunkOpener:
    """How a read checks one stored chunk and, for a sealed payload, opens it into the plaintext.

    `in_place`: the plaintext is the stored bytes (a digest or a tag checks them where they lie);
    otherwise `open` writes the chunk's plaintext into `out`. `identity` names what a buffer was
    checked against, so a buffer checked once is never checked again for the same signed data."""

    name = "sha256"
    in_place = True
    #: stored bytes per chunk beyond its plaintext (an AEAD's tag)
    overhead = 0

    @property
    def identity(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def open(self, index: int, stored: memoryview, out: memoryview) -> bool:
        """Whether stored chunk `index` is authentic (its plaintext, if not in place, now in `out`)."""
        raise NotImplementedError

    def check(self, index: int, pieces: Sequence[memoryview]) -> bool:
        """Whether stored chunk `index`, lying in `pieces` (in order, not contiguous), is authentic;
        only an opener whose plaintext is the stored bytes (`in_place`) can check it where it lies."""
        if len(pieces) == 1:
            return self.open(index, pieces[0], pieces[0])
        raise NotImplementedError(f"{self.name} chunks are checked in one piece")


class Sha256Chunks(ChunkOpener):
    """Each chunk's SHA-256 against the signed list: a manifest that names no keyed tags."""

    def __init__(self, chunk_bytes: int, digests: Sequence[str]) -> None:
        self.chunk_bytes, self.digests = chunk_bytes, tuple(digests)

    @property
    def identity(self) -> tuple[Any, ...]:
        return ("sha256", self.chunk_bytes, self.digests)

    def open(self, index: int, stored: memoryview, out: memoryview) -> bool:
        return self.check(index, [stored])

    def check(self, index: int, pieces: Sequence[memoryview]) -> bool:
        digest = hashlib.sha256()
        for piece in pieces:
            digest.update(piece)
        return index < len(self.digests) and digest.hexdigest() == self.digests[index]


@dataclass(frozen=True)
class PayloadChunking:
    """How a stored payload is cut and checked, as signed data says: a reader allocates `size`
    bytes (`plain_size` for the plaintext of a sealed one) and opens each `chunk_bytes` chunk with
    `opener` as it arrives. `chunks` are the stored chunks' SHA-256 digests (what a store's own
    frame table must list); `opener` defaults to checking those."""

    size: int
    chunk_bytes: int
    chunks: Sequence[str]
    opener: ChunkOpener | None = None
    plain_size: int | None = None

    @property
    def chunk_opener(self) -> ChunkOpener:
        return self.opener if self.opener is not None else Sha256Chunks(self.chunk_bytes, self.chunks)

    @property
    def plaintext_bytes(self) -> int:
        return self.size if self.plain_size is None else self.plain_size

    @property
    def count(self) -> int:
        return -(-self.size // self.chunk_bytes)

    @property
    def plain_chunk_bytes(self) -> int:
        """The plaintext bytes of one stored chunk (less an AEAD's tag)."""
        return self.chunk_bytes - self.chunk_opener.overhead

    def plain_slot(self, plain: "CheckedBuffer", index: int) -> memoryview:
        """Where chunk `index`'s plaintext goes in the plaintext buffer of a payload not opened in place."""
        return plain.view()[index * self.plain_chunk_bytes : (index + 1) * self.plain_chunk_bytes]


@lru_cache(maxsize=1)
def hash_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="kvrag-sha256")


def spans(pieces: Sequence[memoryview], start: int, end: int) -> list[memoryview]:
    """Bytes `start:end` of the concatenation of `pieces` (byte views), as views into the pieces."""
    out, at = [], 0
    for piece in pieces:
        if at >= end:
            break
        lo, hi = max(start - at, 0), min(end - at, len(piece))
        if lo < hi:
            out.append(piece[lo:hi])
        at += len(piece)
    return out


def chunk_digests(data: Any, chunk_bytes: int = CHUNK_BYTES) -> list[str]:
    view = memoryview(data).cast("B")
    chunks = [view[i : i + chunk_bytes] for i in range(0, len(view), chunk_bytes)]
    if len(chunks) <= 1:
        return [hashlib.sha256(c).hexdigest() for c in chunks]
    return list(hash_pool().map(lambda c: hashlib.sha256(c).hexdigest(), chunks))


class CheckedBuffer(mmap.mmap):
    """A fresh, writable buffer for payload bytes; once a store has checked its chunks, it records
    what checked them (`checked_by`), so nothing is checked twice.

    It is memory mapped so that a large one maps pages a dead buffer left resident
    (`kvrag.artifacts.pages`), and a read does not fault in and zero its memory page by page. It is
    not advised for transparent huge pages: in a long-running process the kernel would compact
    memory to find them."""

    #: the `ChunkOpener.identity` that checked it (None: not checked)
    checked_by: tuple[Any, ...] | None = None
    #: the stored bytes it was opened from, when those are not the buffer itself (a sealed payload):
    #: what a tier that keeps stored bytes writes when the state is promoted into it
    sealed: Any = None

    def __new__(cls, size: int) -> "CheckedBuffer":
        buffer = warm_pages().map(cls, size)  # resident pages a dead buffer left (`kvrag.artifacts.pages`)
        if buffer is None:
            buffer = super().__new__(cls, -1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buffer.size_ = size
        return buffer

    def __len__(self) -> int:
        return self.size_

    def view(self) -> memoryview:
        """The buffer's bytes (a zero-length buffer maps one byte it never shows)."""
        return memoryview(self)[: self.size_]


class HeldBytes(bytes):
    """Stored bytes a tier holds in this process, as they were put: immutable, so once a check has
    passed over them it is recorded (`checked_by`, as on a `CheckedBuffer`) and the same check is
    not run again on the next read. Bytes put anew are a new object, checked again."""

    #: the `ChunkOpener.identity` that checked them (None: not checked)
    checked_by: tuple[Any, ...] | None = None


def stored_form(payload: Any) -> Any:
    """The bytes a tier stores for `payload`: a sealed payload's stored bytes, else the payload."""
    sealed = getattr(payload, "sealed", None)
    return payload if sealed is None else sealed


def read_checked(readinto: Callable[[memoryview], int], chunking: PayloadChunking) -> CheckedBuffer | None:
    """`chunking.size` stored bytes read chunk by chunk, each opened on the pool while the next is
    read. The plaintext buffer, or None if a read comes up short or a chunk is not authentic."""
    opener = chunking.chunk_opener
    stored = CheckedBuffer(chunking.size)
    out = stored if opener.in_place else CheckedBuffer(chunking.plaintext_bytes)
    view = stored.view()
    checks = []
    for index, start in enumerate(range(0, chunking.size, chunking.chunk_bytes)):
        chunk = view[start : start + chunking.chunk_bytes]
        if readinto(chunk) != len(chunk):
            return None
        target = chunk if opener.in_place else chunking.plain_slot(out, index)
        checks.append(hash_pool().submit(opener.open, index, chunk, target))
    if not all(check.result() for check in checks):
        return None
    out.checked_by = opener.identity
    if out is not stored:
        out.sealed = stored
    return out


def open_payload(data: Any, chunking: PayloadChunking) -> CheckedBuffer | memoryview | None:
    """The checked plaintext of stored bytes `data` (any buffer): the buffer itself when it was
    checked against this chunking already, else each chunk opened on the pool. None if a chunk is
    not authentic or the size is not the chunking's."""
    opener = chunking.chunk_opener
    if isinstance(data, CheckedBuffer) and data.checked_by == opener.identity:
        return data
    view = data.view() if isinstance(data, CheckedBuffer) else memoryview(data).cast("B")
    if len(view) != chunking.size:
        return None
    if isinstance(data, HeldBytes) and opener.in_place and data.checked_by == opener.identity:
        return view
    out = None if opener.in_place else CheckedBuffer(chunking.plaintext_bytes)
    jobs = []
    for index, start in enumerate(range(0, chunking.size, chunking.chunk_bytes)):
        chunk = view[start : start + chunking.chunk_bytes]
        jobs.append((index, chunk, chunk if out is None else chunking.plain_slot(out, index)))
    if len(jobs) == 1:
        ok = [opener.open(*jobs[0])]
    else:
        ok = list(hash_pool().map(lambda job: opener.open(*job), jobs))
    if not all(ok):
        return None
    if out is None:
        if isinstance(data, HeldBytes):
            data.checked_by = opener.identity
        return view
    out.checked_by = opener.identity
    return out
