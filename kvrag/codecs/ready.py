"""Whole-block K/V buffers of grafted states, kept for the next question over the same bytes.

Under the invariant kernel a full-attention layer's K/V live in a buffer of whole key blocks with
room after them (`GraftCache(in_place=True)`): the question's rows are written after the state's,
and the kernel reads the padded blocks as they lie. Making that buffer copies the grafted layer
(at 4,000 tokens of smollm2-135m, 176 MiB in float32: a fifth of a graft's time to first token).
A state the memory tier holds is grafted again and again from the same immutable bytes, so the
buffer made for one question serves the next: its first rows are the state's, never written; the
rows after them are the question's scratch, zeroed when the next question takes the buffer (so a
buffer's rows past its view are always zeros, whatever the last question wrote there).

A buffer set is *leased* to one cache at a time (a second question at once makes its own copy, as
before) and returned when that cache is done. It is kept only while its source bytes are: an
entry holds a weak reference to a source that allows one (a read's buffer: gone with its
question), else the source itself (bytes the memory tier holds), and the whole is bounded by
`max_bytes`, least recently used first out.

When a source goes (a Redis or disk read, once its question is done), its set, no longer leased,
becomes *spare*: the next graft of a like shape copies its state into a spare buffer instead of
fresh memory, which the kernel would fault in and zero page by page (on this project's VMs as
costly as the copy itself). A spare's rows past what a graft writes, which held an earlier
question's K/V, are zeroed when it is taken, as a fresh buffer's are.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from typing import Any, Sequence

import torch

__all__ = ["ReadyBuffers", "Lease", "DEFAULT_READY_BYTES"]

#: what the kept buffers (and sources kept alive by them) may hold in all, by default
DEFAULT_READY_BYTES = int(float(os.environ.get("KVRAG_READY_BUFFERS_MIB", "1024")) * 2**20)


class _Entry:
    def __init__(self, sources: Sequence[Any]) -> None:
        self.refs: list[Any] = []
        self.held: list[Any] = []  # sources that take no weak reference (immutable bytes a tier holds)
        for source in sources:
            try:
                self.refs.append(weakref.ref(source))
            except TypeError:
                self.held.append(source)
                self.refs.append(lambda source=source: source)
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.leased = False
        #: its source went while it was leased: spare once given back
        self.orphaned = False
        self.size = sum(len(source) for source in self.held)

    def alive(self, sources: Sequence[Any]) -> bool:
        return len(sources) == len(self.refs) and all(ref() is source for ref, source in zip(self.refs, sources))


class Lease:
    """One cache's use of a kept buffer set: `get(i)` a layer's buffers (or None), `keep(i, ...)`
    the buffers a layer just made, `give_back()` when the cache is done (also on its collection)."""

    def __init__(self, pool: "ReadyBuffers", key: tuple[Any, ...], entry: _Entry) -> None:
        self.pool, self.key, self.entry = pool, key, entry
        self.returned = False

    def get(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.returned else self.entry.layers.get(layer_idx)

    def keep(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if not self.returned:
            self.pool._keep(self, layer_idx, keys, values)

    def spare(self, like: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A spare K/V buffer pair shaped like `like` ([b, h, n, d]) with at least `rows` positions
        (and fewer than twice as many), taken out of the pool, or None."""
        return None if self.returned else self.pool._take_spare(like, rows)

    def give_back(self) -> None:
        if not self.returned:
            self.returned = True
            self.pool._give_back(self)


class ReadyBuffers:
    """Kept whole-block buffers, by the identity of the immutable source bytes they were copied from."""

    def __init__(self, max_bytes: int = DEFAULT_READY_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        #: buffer pairs of sets whose source went, oldest first
        self._spares: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._lock = threading.Lock()
        self.bytes_held = 0
        self.reuses = 0
        #: grafts that copied into a spare buffer instead of fresh memory
        self.spares_taken = 0

    def lease(self, sources: Sequence[Any], spans: Sequence[tuple[int, int]]) -> Lease | None:
        """The buffer set for the parts read from `sources` (one per part, spanning `spans`), leased
        to the caller; None if another cache holds it now, or if nothing can be kept."""
        if self.max_bytes <= 0 or not sources or any(source is None for source in sources):
            return None
        key = tuple((id(source), start, end) for source, (start, end) in zip(sources, spans))
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and not entry.alive(sources):  # an id now another object's: a stale entry
                self._drop(key)
                entry = None
            if entry is None:
                entry = _Entry(sources)
                self._entries[key] = entry
                self.bytes_held += entry.size
                for ref in entry.refs:
                    if isinstance(ref, weakref.ref):
                        weakref.finalize(ref(), self._forget, key, entry)  # gone with its source
            elif entry.leased:
                return None
            elif entry.layers:
                self.reuses += 1
            entry.leased = True
            self._entries.move_to_end(key)
            return Lease(self, key, entry)

    def _keep(self, lease: Lease, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        with self._lock:
            if lease.entry.orphaned:  # its source went meanwhile (a chain's parts, joined at install)
                lease.entry.layers[layer_idx] = (keys, values)  # spare once given back
                return
            if self._entries.get(lease.key) is not lease.entry:
                return
            before = lease.entry.layers.get(layer_idx)
            grown = keys.nbytes + values.nbytes - (0 if before is None else before[0].nbytes + before[1].nbytes)
            lease.entry.layers[layer_idx] = (keys, values)
            lease.entry.size += grown
            self.bytes_held += grown
            self._bound(keep=lease.key)

    def _give_back(self, lease: Lease) -> None:
        with self._lock:
            lease.entry.leased = False
            if lease.entry.orphaned:
                self._spare(lease.entry)
            self._bound()

    def _take_spare(self, like: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self._lock:
            for index, (keys, values) in enumerate(self._spares):
                if (keys.shape[:-2] == like.shape[:-2] and keys.shape[-1] == like.shape[-1] and keys.dtype == like.dtype
                        and keys.device == like.device and rows <= keys.shape[-2] < 2 * rows):
                    del self._spares[index]
                    self.bytes_held -= keys.nbytes + values.nbytes
                    self.spares_taken += 1
                    return keys, values
        return None

    def _spare(self, entry: _Entry) -> None:
        """An entry whose source went and no cache holds: its buffers kept as spares (within the bound)."""
        for keys, values in entry.layers.values():
            self._spares.append((keys, values))
            self.bytes_held += keys.nbytes + values.nbytes
        entry.layers = {}

    def _bound(self, keep: tuple[Any, ...] | None = None) -> None:
        while self._spares and self.bytes_held > self.max_bytes:
            keys, values = self._spares.pop(0)
            self.bytes_held -= keys.nbytes + values.nbytes
        for key in [k for k in self._entries if k != keep]:
            if self.bytes_held <= self.max_bytes:
                break
            if not self._entries[key].leased:
                self._drop(key)
        if self.bytes_held > self.max_bytes and keep in self._entries and not self._entries[keep].leased:
            self._drop(keep)

    def _forget(self, key: tuple[Any, ...], entry: _Entry) -> None:
        """`entry`'s source went: its buffers become spares (once no cache holds them)."""
        with self._lock:
            if self._entries.get(key) is entry:
                self._drop(key)
                if entry.leased:
                    entry.orphaned = True
                else:
                    self._spare(entry)
                self._bound()

    def _drop(self, key: tuple[Any, ...]) -> None:
        entry = self._entries.pop(key)
        self.bytes_held -= entry.size

    def __len__(self) -> int:
        """How many buffer sets are kept (leased or not)."""
        return len(self._entries)
