"""The schedule: which token ids are fed in which segment, and the content address of each.

A prompt for k documents is fed as `[prefix + doc 1] [doc 2] ... [doc k] [question + suffix]`
(see `kvrag.core.prompt`). Each context segment's key is the SHA-256 of (scope, parent key, token ids),
so identical work maps to the identical key and a state is only ever found at its own position
after its own chain. The scope is the engine's (see `kvrag.trust.identity`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pydantic import BaseModel, ConfigDict

from kvrag.artifacts.format import state_key
from kvrag.core.prompt import PromptLayout
from kvrag.errors import ContextTooLongError, ForeignStateError
from kvrag.trust.identity import EngineIdentity

__all__ = ["Segment", "StateRef", "Planner", "MAX_CHARS_PER_POSITION"]

#: Text longer than this many characters per model position is refused before it is tokenized.
MAX_CHARS_PER_POSITION = 32


@dataclass(frozen=True)
class Segment:
    """A run of token ids fed in one forward call, with its key, parent and first position."""

    text: str
    ids: list[int]
    key: str
    parent_key: str | None
    start: int
    #: the prompt layout it was cut by (`chat`, `completion`, or a rendered prompt's form)
    layout: str = ""

    @property
    def end(self) -> int:
        return self.start + len(self.ids)


class StateRef(BaseModel):
    """A JSON-safe handle on a deposited state: enough to graft it, or to re-read its text."""

    model_config = ConfigDict(frozen=True)

    key: str
    parent_key: str | None
    start: int
    token_count: int
    text: str
    model_fingerprint: str
    #: the public id of the key scope it was deposited in (a hash of the scope: it reveals neither
    #: the signing key nor any address)
    scope: str = ""

    @property
    def end(self) -> int:
        return self.start + self.token_count

    def foreign_to(self, scope_id: str) -> bool:
        """Whether it was deposited in another key scope than `scope_id` (an engine's `scope_id`)."""
        return bool(self.scope) and self.scope != scope_id


class Planner:
    """Segments for one engine (its identity, layout and the model's maximum positions)."""

    def __init__(self, layout: PromptLayout, identity: EngineIdentity, max_positions: int) -> None:
        self.layout = layout
        self.identity = identity
        self.fingerprint = identity.model_digest
        self.max_positions = max_positions
        self.model_name = identity.model.name

    def key(self, parent_key: str | None, ids: Sequence[int]) -> str:
        return state_key(self.identity.scope, parent_key, list(ids))

    def segment(self, text: str, ids: Sequence[int], after: Segment | StateRef | None, layout: str | None = None) -> Segment:
        """The segment of `ids` continuing `after` (or starting the prompt), cut by `layout` (default: the planner's)."""
        parent = after.key if after is not None else None
        start = after.end if after is not None else 0
        return Segment(text, list(ids), self.key(parent, ids), parent, start, layout or self.layout.kind)

    def check_size(self, text: str) -> str:
        """`text`, unless it is too long to fit the model whatever its tokens (refused before tokenizing)."""
        if len(text) > self.max_positions * MAX_CHARS_PER_POSITION:
            raise ContextTooLongError(
                f"a text of {len(text):,} characters cannot fit {self.model_name}'s {self.max_positions:,} positions; "
                "split it into smaller documents"
            )
        return text

    def chain(self, pieces: Sequence[tuple[str, Sequence[int]]], layout: str | None = None) -> list[Segment]:
        """The segments of pieces (text, ids) read one after another from the start of a prompt."""
        segments: list[Segment] = []
        for text, ids in pieces:
            segments.append(self.segment(text, ids, segments[-1] if segments else None, layout))
        return segments

    def documents(self, texts: Sequence[str], *, after: StateRef | None = None) -> list[Segment]:
        """The segments of documents read in order, optionally after a chain."""
        self.check_after(after)
        segments: list[Segment] = []
        previous: Segment | StateRef | None = after
        for text in texts:
            segment = self.segment(text, self.layout.segment_ids(self.check_size(text), first=previous is None), previous)
            segments.append(segment)
            previous = segment
        self.check_length(segments[-1].end if segments else (after.end if after else 0))
        return segments

    def question(self, query: str, context: Sequence[Segment]) -> list[int]:
        """The ids fed after the context: the question (and the prompt prefix when there is no context)."""
        ids = self.layout.question_ids(self.check_size(query))
        return ids if context else list(self.layout.prefix_ids) + ids

    def ref(self, segment: Segment) -> StateRef:
        return StateRef(key=segment.key, parent_key=segment.parent_key, start=segment.start,
                        token_count=len(segment.ids), text=segment.text, model_fingerprint=self.fingerprint,
                        scope=self.identity.scope_id)

    def check_length(self, positions: int) -> None:
        if positions > self.max_positions:
            raise ContextTooLongError(
                f"the prompt needs {positions} positions but {self.model_name} has {self.max_positions}; "
                "pass fewer or shorter documents"
            )

    def check_after(self, after: StateRef | None) -> None:
        if after is not None and after.model_fingerprint != self.fingerprint:
            raise ForeignStateError(
                f"state {after.key[:12]} was deposited with another model (fingerprint "
                f"{after.model_fingerprint[:12]}, this engine's is {self.fingerprint[:12]}); "
                "deposit the chain again with this model"
            )
        if after is not None and after.foreign_to(self.identity.scope_id):
            raise ForeignStateError(
                f"state {after.key[:12]} was deposited in another scope (another signing key, namespace or "
                "hardware); deposit the chain again with this engine"
            )
