"""A continuation: what to run (a schedule grafted where stored, some ids fed, up to N tokens
decoded). Every answer kvrag gives is one: `KVEngine.generate`, a memo recall, the A/B harness's
arms; `kvrag.engine.continuer` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvrag.core.sampling import Sampling
from kvrag.core.schedule import Segment, StateRef
from kvrag.stores.deadline import Deadline

__all__ = ["Continuation"]


@dataclass(frozen=True)
class Continuation:
    """What to run: `context` segments (grafted where stored, else text), then `feed` in one
    forward call, then up to `max_new_tokens` decoded tokens.

    `requested` is what the caller asked for per context segment (a ref deposited elsewhere is
    `moved`; with `approximate` it is moved there instead of re-read). `known` are answer ids
    already given (their text starts the answer; decoding continues after them). With `memo`,
    the last context segment is a memo state that must graft, and the receipt says `memo`. With
    `blend` (a ratio), such a ref is moved and that share of its tokens recomputed (`kvrag.reuse.blend`).
    """

    context: Sequence[Segment]
    feed: Sequence[int]
    max_new_tokens: int
    stop: Sequence[str] = ()
    graft: bool = True
    requested: Sequence[StateRef | str] | None = None
    approximate: bool = False
    known: Sequence[int] = ()
    memo: bool = False
    deadline: Deadline | None = None  # for every store read (default: the engine's, from the start)
    sampling: Sampling | None = None  # greedy when None
    blend: float | None = None  # move refs deposited elsewhere and recompute this share of their tokens
    rerotate: bool = True  # moved keys re-rotated to their new positions (False only to measure the harm)
    notes: Sequence[str] = ()  # said in the receipt (e.g. why a blend asked for was refused)
    any_boundary: bool = False  # graft the longest stored prefix first, wherever it ends (`kvrag.core.prefixes`)
    layout: str = ""  # how the prompt was laid out, said in the receipt (see `Receipt.layout`)

    @property
    def prompt_tokens(self) -> int:
        return (self.context[-1].end if self.context else 0) + len(self.feed)
