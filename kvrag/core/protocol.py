"""What the applications built on an engine need of it: its identity, its planner and layout, its
sealed records, deposits, checks, and running a continuation. `KVEngine` is one; the reuse levers,
the library and the A/B harness depend on this, not on the engine class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from typing_extensions import Unpack

from kvrag.core.continuation import Continuation
from kvrag.core.decoding import Generation, GenerationStream
from kvrag.core.options import GenerationOptions, GenerationSettings
from kvrag.core.prompt import PromptLayout
from kvrag.core.schedule import Planner, Segment, StateRef
from kvrag.models.loading import LoadedModel
from kvrag.stores import StateStore
from kvrag.stores.deadline import Deadline
from kvrag.trust.identity import EngineIdentity
from kvrag.trust.records import SealedRecords

__all__ = ["Engine", "BlendLimits"]


@dataclass(frozen=True)
class BlendLimits:
    """The most an engine lets an approximate blend deviate from the exact path: mean first-token
    KL (nats) at most `max_mean_kl`, argmax agreement at least `min_agreement`. The engine's own
    setting, applied to every stored gate verdict; a calibration cannot loosen it."""

    max_mean_kl: float = 0.1
    min_agreement: float = 0.8


class Engine(Protocol):
    """An engine as the features built on it see it."""

    identity: EngineIdentity
    model: LoadedModel
    store: StateStore
    layout: PromptLayout
    planner: Planner
    records: SealedRecords
    deadline_s: float
    blend_limits: BlendLimits

    def plan(self, texts: Sequence[str], *, after: StateRef | None = None) -> list[Segment]:
        """The segments (ids, keys, positions) for documents read in order."""

    def ref(self, text: str, *, after: StateRef | None = None) -> StateRef:
        """The ref a deposit of `text` would return, without computing anything."""

    def holds(self, ref: StateRef) -> bool:
        """Whether the store holds `ref` whole."""

    def ensure(self, text: str, *, after: StateRef | None = None) -> StateRef:
        """The ref for `text`, deposited first if missing."""

    def deposit_chain(self, texts: Sequence[str], *, after: StateRef | None = None) -> list[StateRef]:
        """Deposit documents as one chain."""

    def check(self, segment: Segment, deadline: Deadline | None = None) -> None:
        """Raise the `StateError` that says why `segment`'s stored state cannot be grafted (if any)."""

    def run(self, continuation: Continuation) -> GenerationStream:
        """Run a continuation."""

    def generate(self, query: str, *, states: Sequence[StateRef | str] | None = None,
                 options: GenerationOptions | None = None, **settings: Unpack[GenerationSettings]) -> Generation:
        """Answer `query` (see `KVEngine.stream`)."""

    def tokenize(self, text: str) -> list[int]:
        """`text`'s token ids, without special tokens."""

