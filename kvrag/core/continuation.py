"""A continuation: what to run. Its plan says, per context segment, where that segment's K/V come
from (its own stored state, a state deposited elsewhere moved or blended here, a memo state, the
text), then `feed` is read in one forward call and up to N tokens decoded. Every answer kvrag gives
is one: `KVEngine.generate`, a memo recall, the gate's trials, the A/B harness's arms.

Whoever builds a continuation decides its plan (`plan_segments`, the engine's policy); `kvrag.engine.continuer`
runs it as planned and decides nothing but the fallback every step has: a state that fails its
checks is read as text in its own segment, and the receipt says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from kvrag.core.sampling import Sampling
from kvrag.core.schedule import Segment, StateRef
from kvrag.stores.deadline import Deadline

__all__ = ["Continuation", "Step", "Prefix", "Graft", "Move", "Blend", "Recall", "Text", "plan_segments"]


@dataclass(frozen=True)
class Prefix:
    """First, graft the longest stored chain the context's tokens begin with, wherever it ends
    (`kvrag.core.prefixes`), if it covers more than the context's own stored states do. The
    segments it covers are skipped; the one it ends inside is read as text from there on."""


@dataclass(frozen=True)
class Graft:
    """Graft the segment's own state, else read its text. `requested`: the ref the caller put
    here, where it is another state (deposited elsewhere or in another scope), named in the receipt."""

    segment: Segment
    requested: StateRef | None = None


@dataclass(frozen=True)
class Move:
    """Graft the segment's own state, else move `ref`'s (deposited at other positions) here, its
    keys re-rotated (unless `rerotate` is False, only to measure the harm): an approximate graft;
    else read the text."""

    segment: Segment
    ref: StateRef
    rerotate: bool = True


@dataclass(frozen=True)
class Blend:
    """As `Move`, then recompute `ratio` of the moved tokens (`kvrag.reuse.blend`)."""

    segment: Segment
    ref: StateRef
    ratio: float
    rerotate: bool = True


@dataclass(frozen=True)
class Recall:
    """Graft a memo state (a verified answer's ids after the context): it must graft, a failure
    is raised, never read as text; the receipt says `memo`."""

    segment: Segment


@dataclass(frozen=True)
class Text:
    """Read the segment as text, for `reason` (said in the receipt with `detail`; `requested`
    as for `Graft`)."""

    segment: Segment
    reason: str = "graft-off"
    detail: str = "grafting was turned off for this generation"
    requested: StateRef | None = None


Step = Union[Prefix, Graft, Move, Blend, Recall, Text]


def plan_segments(segments: Sequence[Segment], requested: Sequence[StateRef | str] | None = None, *, scope: str = "",
         graft: bool = True, approximate: bool = False, blend: float | None = None, rerotate: bool = True,
         prefix: bool = False) -> tuple[Step, ...]:
    """The engine's policy, per segment: with `graft` off, its text; where the caller put a ref
    deposited at other positions of this scope (`scope`: the engine's `scope_id`), that ref
    blended (`blend`, a ratio) or moved (`approximate`) if the segment's own state fails; else
    its own state. With `prefix`, the longest stored prefix first."""
    steps: list[Step] = [Prefix()] if prefix and graft and segments else []
    for index, segment in enumerate(segments):
        req = requested[index] if requested else None
        other = req if isinstance(req, StateRef) and req.key != segment.key else None
        foreign = other is not None and other.foreign_to(scope)
        if not graft:
            steps.append(Text(segment, requested=other))
        elif other is not None and not foreign and blend is not None:
            steps.append(Blend(segment, other, blend, rerotate))
        elif other is not None and not foreign and approximate:
            steps.append(Move(segment, other, rerotate))
        else:
            steps.append(Graft(segment, other))
    return tuple(steps)


@dataclass(frozen=True)
class Continuation:
    """What to run: the `plan`'s context segments, then `feed` in one forward call, then up to
    `max_new_tokens` decoded tokens. `known` are answer ids already given (their text starts the
    answer; decoding continues after them)."""

    plan: Sequence[Step]
    feed: Sequence[int]
    max_new_tokens: int
    stop: Sequence[str] = ()
    known: Sequence[int] = ()
    deadline: Deadline | None = None  # for every store read (default: the engine's, from the start)
    sampling: Sampling | None = None  # greedy when None
    notes: Sequence[str] = ()  # said in the receipt (e.g. why a blend asked for was refused)
    layout: str = ""  # how the prompt was laid out, said in the receipt (see `Receipt.layout`)

    @property
    def context(self) -> list[Segment]:
        """The context segments, in order."""
        return [step.segment for step in self.plan if not isinstance(step, Prefix)]

    @property
    def memo(self) -> bool:
        """Whether this answers from a memo state (`Recall`)."""
        return any(isinstance(step, Recall) for step in self.plan)

    @property
    def blend(self) -> float | None:
        """The share of moved tokens recomputed, where the plan blends."""
        return next((step.ratio for step in self.plan if isinstance(step, Blend)), None)

    @property
    def grafts(self) -> list[Segment]:
        """The segments whose stored states the plan reads."""
        return [step.segment for step in self.plan if isinstance(step, (Graft, Move, Blend, Recall))]

    @property
    def prompt_tokens(self) -> int:
        context = self.context
        return (context[-1].end if context else 0) + len(self.feed)
