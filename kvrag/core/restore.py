"""Restoring states: a store's checked read (tier by tier, see `kvrag.stores`) with this engine's
acceptance checks, for one state or for the chain that ends at one."""

from __future__ import annotations

from kvrag.codecs import StatePart
from kvrag.core.acceptance import Restored, StateAcceptance
from kvrag.core.prefill import Graftable
from kvrag.core.schedule import Segment
from kvrag.core.streaming import StreamedTensors, start_stream
from kvrag.errors import StoreTimeoutError
from kvrag.stores import Found, StateStore
from kvrag.stores.deadline import Deadline

__all__ = ["Restorer"]


class Restorer:
    def __init__(self, store: StateStore, acceptance: StateAcceptance) -> None:
        self.store = store
        self.acceptance = acceptance

    def fetch(self, key: str, expect: Segment | None = None, deadline: Deadline | None = None) -> Found[Restored]:
        """The first copy of `key` that passes every check, read within `deadline`; raises the
        `StateError` saying why none did."""
        return self.store.fetch(key, self.acceptance.expecting(key, expect), deadline)

    def graftable(self, segment: Segment, deadline: Deadline | None = None, *, stream: bool = False) -> Graftable:
        """`segment`'s state as a part to graft, with notes on the tiers that could not serve it.

        `stream`: returned as soon as its manifest is accepted, its layers' tensors arriving while
        the forward that uses them runs (see `kvrag.core.streaming`)."""
        if not stream:
            found = self.fetch(segment.key, segment, deadline)
            return Graftable(found.value.part, found.tier, found.notes)
        progress = start_stream(self.store, segment.key, self.acceptance.expecting(segment.key, segment), deadline)
        if progress.result is None and progress.failure is None and progress.manifest is not None:
            manifest = progress.manifest
            tensors = StreamedTensors(segment.key, progress, deadline)
            return Graftable(StatePart(manifest.start, manifest.end, manifest.layers, tensors), progress.tier or "",
                             stream=progress)
        # The stream failed before its graft began (or the read ended first): what the read goes on
        # to find whole in a later tier is grafted as it came, else the read's first error is raised.
        found = progress.ended(deadline)
        if found is None:
            raise progress.failure or StoreTimeoutError("the state's read did not end within the question's deadline", key=segment.key)
        return Graftable(found.value.part, found.tier, found.notes)

    def chain(self, key: str | None, deadline: Deadline | None = None) -> list[Restored]:
        """The chain ending at `key`, root first, each state checked as for a graft, all read within `deadline`."""
        chain: list[Restored] = []
        while key is not None:
            restored = self.fetch(key, None, deadline).value
            chain.append(restored)
            key = restored.manifest.parent_key
        chain.reverse()
        return chain

    def holds(self, key: str, deadline: Deadline | None = None) -> bool:
        """Whether some tier holds `key` whole, manifest and every part of its payload, answered
        within `deadline` (cheap: nothing is hashed; a tier that fails to answer in time counts as
        not holding it)."""
        return self.store.holds(key, deadline)
