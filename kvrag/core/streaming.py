"""A graft that starts before its state has arrived: layers used as soon as their chunks are checked.

A state's payload lies in layer order (`kvrag.artifacts.format.encode_payload`). A streamed
restore runs the store's checked read on a thread of its own; each chunk the store's hashing
threads open is noted here (`ChunkProgress`), and the question's forward, reaching layer i, asks
for layer i's tensors (`StreamedTensors`), waiting only for the chunks that hold them. So the
forward never sees an unchecked byte. If any chunk fails its check, or a second tier has to be
read, the stream fails: the forward that was waiting raises `StreamFailedError`, its cache is thrown
away, and the continuation is read again without streaming (the next tier or the text answers).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Iterator, Mapping

import torch

from kvrag.artifacts.digests import ChunkOpener, PayloadChunking
from kvrag.artifacts.format import StateManifest, header_bytes, payload_plan, tensor_names, tensor_over
from kvrag.core.acceptance import Restored
from kvrag.errors import IntegrityError, StateError, StoreTimeoutError, StoreUnavailableError, StreamFailedError
from kvrag.stores import Accepted, Found, StateStore
from kvrag.stores.deadline import Deadline, submit_read

__all__ = ["ChunkProgress", "StreamedTensors", "start_stream"]


class ChunkProgress:
    """Which chunks of one read are checked, where their plaintext lies, and how the read ended."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._cond = threading.Condition()
        self.manifest: StateManifest | None = None
        self.chunking: PayloadChunking | None = None
        self.tier: str | None = None
        self._buffer: Any = None
        self._opened: set[int] = set()
        self.failure: StateError | None = None
        self.result: Found[Restored] | None = None
        self.began = time.perf_counter()
        self.finished_s: float | None = None
        self.accepted_s = 0.0
        #: the read has ended (well: `result`; badly: `failure`)
        self.done = False

    # --- reported by the read, on the store's threads
    def accepted(self, manifest: StateManifest, chunking: PayloadChunking, tier: str) -> bool:
        """The manifest passed; False if one was accepted already (a second tier: not streamed)."""
        with self._cond:
            if self.manifest is not None:
                self._fail(StoreUnavailableError("the state's first tier failed after its manifest was accepted"))
                return False
            self.manifest, self.chunking, self.tier = manifest, chunking, tier
            self.accepted_s = time.perf_counter() - self.began
            self._cond.notify_all()
            return True

    def opened(self, index: int, plain: memoryview, ok: bool) -> None:
        with self._cond:
            if not ok:
                self._fail(IntegrityError(f"chunk {index} did not pass its check"))
                return
            if self._buffer is None:
                self._buffer = plain.obj  # the one plaintext buffer every chunk's view slices
            self._opened.add(index)
            self._cond.notify_all()

    def finish(self, future: Future) -> None:
        with self._cond:
            self.done = True
            self.finished_s = time.perf_counter() - self.began
            error = future.exception()
            if error is None:
                self.result = future.result()
            elif isinstance(error, StateError):
                self._fail(error)
            else:
                self._fail(IntegrityError(f"the read failed: {type(error).__name__}: {str(error)[:200]}"))
            self._cond.notify_all()

    def _fail(self, error: StateError) -> None:
        if self.failure is None:
            self.failure = error
        self._cond.notify_all()

    # --- asked by the forward, on the caller's thread
    def _until(self, done: Any, deadline: Deadline | None) -> bool:
        """Wait, holding the lock, until `done()`; False if it still does not hold at the limit. The
        read itself is bounded by `deadline` (the store's guard ends it with a timeout), so the wait
        is too; a last-resort limit a second past it guards against a read that never reports."""
        limit = None if deadline is None else time.monotonic() + max(deadline.remaining(), 0.0) + 1.0
        while not done():
            remaining = None if limit is None else limit - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._cond.wait(remaining)
        return True

    def wait(self, ready: Any, deadline: Deadline | None) -> None:
        """Until `ready()` holds, or the read failed (its error, raised) or finished."""
        with self._cond:
            if not self._until(lambda: self.failure is not None or self.result is not None or ready(), deadline):
                self._fail(StoreTimeoutError("the state did not arrive within the question's deadline"))
            if self.failure is not None:
                raise self.failure

    def ended(self, deadline: Deadline | None) -> Found[Restored] | None:
        """Wait for the read to end, however it ends (within `deadline` and a second); what it found
        whole and checked, if anything (a later tier's copy, after this tier's stream failed)."""
        with self._cond:
            self._until(lambda: self.done, deadline)
            return self.result

    def settle(self, deadline: Deadline | None) -> None:
        """Wait for the read to end; `StreamFailedError` unless it ended well."""
        try:
            self.wait(lambda: False, deadline)
        except StateError as e:
            raise StreamFailedError(self.key, e) from e
        if self.result is None:  # ended by the deadline, with no failure recorded
            raise StreamFailedError(self.key, StoreTimeoutError("the state's read did not end within the deadline"))

    @property
    def buffer(self) -> Any:
        """The plaintext buffer the opened chunks lie in (None before the first is opened)."""
        return self._buffer

    def chunks_ready(self, first: int, last: int) -> bool:
        return all(i in self._opened for i in range(first, last + 1))


class _StreamOpener(ChunkOpener):
    """The chunking's own check, each result noted in the progress."""

    def __init__(self, inner: ChunkOpener, progress: ChunkProgress) -> None:
        self.inner, self.progress = inner, progress
        self.name, self.in_place, self.overhead = inner.name, inner.in_place, inner.overhead

    @property
    def identity(self) -> tuple[Any, ...]:
        return self.inner.identity

    def open(self, index: int, stored: memoryview, out: memoryview) -> bool:
        ok = self.inner.open(index, stored, out)
        self.progress.opened(index, out, ok)
        return ok


class _StreamAcceptance:
    """A reader's `Acceptance` whose accepted manifest and opened chunks are reported as they happen."""

    def __init__(self, acceptance: Any, progress: ChunkProgress) -> None:
        self.acceptance, self.progress = acceptance, progress

    def manifest(self, raw: bytes, store: StateStore) -> Accepted:
        accepted = self.acceptance.manifest(raw, store)
        chunking = accepted.chunking
        assert chunking is not None
        streamed = PayloadChunking(chunking.size, chunking.chunk_bytes, chunking.chunks, _StreamOpener(chunking.chunk_opener, self.progress),
                                 chunking.plain_size)
        if not self.progress.accepted(accepted.value, chunking, store.url):
            return accepted  # a later tier: read as usual, for the promotion (the stream has failed)
        return Accepted(accepted.value, streamed)

    def payload(self, manifest: Any, payload: Any) -> Restored:
        return self.acceptance.payload(manifest, payload)


class StreamedTensors(Mapping[str, torch.Tensor]):
    """A streamed state's tensors by name: each waits for the chunks that hold it, then views them."""

    def __init__(self, key: str, progress: ChunkProgress, deadline: Deadline | None) -> None:
        self.key, self.progress, self.deadline = key, progress, deadline
        assert progress.manifest is not None and progress.chunking is not None
        self.manifest, self.chunking = progress.manifest, progress.chunking
        self._plan: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] | None = None
        self._names = [name for i in range(len(self.manifest.layers)) for name in tensor_names(i)]

    def _chunk_of(self, offset: int) -> int:
        return offset // self.chunking.plain_chunk_bytes

    def _get(self, name: str) -> torch.Tensor:
        progress = self.progress
        try:
            if self._plan is None:
                progress.wait(lambda: progress.chunks_ready(0, 0), self.deadline)
                if progress.result is None:
                    head = memoryview(progress.buffer)[:16]
                    need = header_bytes(head) if len(head) >= 8 else 8
                    last = self._chunk_of(max(need, 1) - 1)
                    progress.wait(lambda: progress.chunks_ready(0, last), self.deadline)
            if progress.result is not None:
                return progress.result.value.part.tensors[name]
            if self._plan is None:
                self._plan = payload_plan(memoryview(progress.buffer), self.manifest)
            dtype, shape, begin, end = self._plan[name]
            first, last = self._chunk_of(begin), self._chunk_of(max(end, begin + 1) - 1)
            progress.wait(lambda: progress.chunks_ready(first, last), self.deadline)
            if progress.result is not None:
                return progress.result.value.part.tensors[name]
            return tensor_over(progress.buffer, dtype, shape, begin, end)
        except StateError as e:
            raise StreamFailedError(self.key, e) from e

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def start_stream(store: StateStore, key: str, acceptance: Any, deadline: Deadline | None) -> ChunkProgress:
    """Start reading `key` through `check` on a thread of its own; returns once its manifest is
    accepted (`progress.manifest` set) or the read ended (`progress.result` or `progress.failure`)."""
    progress = ChunkProgress(key)
    future = submit_read(lambda: store.fetch(key, _StreamAcceptance(acceptance, progress), deadline))
    future.add_done_callback(progress.finish)
    try:
        progress.wait(lambda: progress.manifest is not None, deadline)
    except StateError:
        pass  # the caller reads `progress.failure`
    return progress
