"""A cache being filled segment by segment: stored parts grafted, text prefilled, both timed.

Consecutive grafts are queued and grafted in one go (one concatenation per layer); text is
prefilled in order after whatever was queued. A streamed state's layers are grafted as the
forward reaches them (`GraftCache.defer`), so its restore and the forward overlap; its restore
time is the read's whole duration. The counters and timings feed the receipt.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from kvrag.codecs import ReadyBuffers, StatePart, install
from kvrag.core.runner import ModelRunner

__all__ = ["Graftable", "Prefill"]


@dataclass(frozen=True)
class Graftable:
    """A part to graft, the tier it came from, notes on hotter tiers that missed, and any ids
    that must be read as text just before it (a moved first document's prompt prefix)."""

    part: StatePart
    tier: str
    notes: str | None = None
    text_before: Sequence[int] = field(default_factory=tuple)
    #: the read still in progress (`kvrag.core.streaming.ChunkProgress`) when the part is streamed
    stream: Any = None


class Prefill:
    """`forward`: how a read is run (`runner.forward` unless a batch carries it: `Lane.read`)."""

    def __init__(self, runner: ModelRunner, ready: ReadyBuffers | None = None,
                 forward: Callable[[Sequence[int], Any], torch.Tensor] | None = None) -> None:
        self.runner = runner
        self.forward = forward or runner.forward
        self.cache: Any = runner.new_cache(ready)
        self.pending: list[StatePart] = []
        self.streams: list[Any] = []
        self.restore_s = self.prefill_s = 0.0
        self.reused = self.prefilled = 0

    def graft(self, fetched: Graftable) -> Graftable:
        """Queue a fetched part (its `text_before`, if any, prefilled first)."""
        self.admit(fetched)
        self.pending.append(fetched.part)
        if fetched.stream is not None:
            self.streams.append(fetched.stream)
        self.reused += fetched.part.end - fetched.part.start
        return fetched

    @contextmanager
    def restoring(self) -> Iterator[None]:
        """Time what the block does (fetching a part) as restore."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.restore_s += time.perf_counter() - t

    def flush(self, *, deferred: bool = False) -> None:
        """Graft what is queued; `deferred`: a streamed part's layers as the next forward reaches them."""
        t = time.perf_counter()
        install(self.runner.codecs, self.cache, self.pending, self.runner.device, deferred=deferred and bool(self.streams))
        self.pending = []
        if not deferred:
            self.cache.settle()
        self.restore_s += time.perf_counter() - t

    def text(self, ids: Sequence[int]) -> torch.Tensor:
        """Prefill `ids` in one forward call after everything queued; the last position's logits."""
        self.flush(deferred=True)
        t = time.perf_counter()
        logits = self.forward(ids, self.cache)
        self.cache.settle()
        self.prefill_s += time.perf_counter() - t
        self.prefilled += len(ids)
        return logits

    def drop_streams(self, deadline: Any) -> dict[str, Any]:
        """After a stream failed: wait (within `deadline`) for the streamed reads to end, and return
        those that a later tier served whole and checked (`Found`s by key), to graft unstreamed."""
        found = {}
        for stream in self.streams:
            result = stream.ended(deadline)
            if result is not None:
                found[stream.key] = result
        self.streams = []
        return found

    def end_streams(self, deadline: Any) -> dict[str, str | None]:
        """Wait (within `deadline`) for the streamed reads to end; each one's notes on the tiers
        that missed, by key. Its read's whole duration, overlapped with the forward, is its
        restore time. Raises `StreamFailedError` if a read ended badly: the forward is not used."""
        notes = {}
        for stream in self.streams:
            stream.settle(deadline)
            self.restore_s += max(0.0, (stream.finished_s or 0.0) - stream.accepted_s)  # the rest was timed in `fetch`
            notes[stream.key] = stream.result.notes
        self.streams = []
        return notes

    def admit(self, fetched: Graftable) -> None:
        """Prefill the ids a fetched part needs read as text just before it."""
        if fetched.text_before:
            self.text(fetched.text_before)
