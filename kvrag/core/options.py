"""The settings of one generation, in one object every entry point takes.

`GenerationOptions` is what `KVEngine.stream`, `stream_chat` and `stream_complete` run with, what
`kvrag serve` builds from a request and what the framework adapters build from their fields.
`GenerationSettings` names the same fields as keyword arguments (`engine.generate(q,
max_new_tokens=8)`), each overriding the options object given, if any.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Literal, Sequence

from typing_extensions import TypedDict

from kvrag.core.sampling import Sampling
from kvrag.errors import InputError

__all__ = ["GenerationOptions", "GenerationSettings", "options_of", "Order", "RAG_DEFAULTS"]

#: the order documents are read in: as given (`retrieval`), one fixed order per set (`canonical`, by
#: the hash of each text) or the longest stored chain first (`stored-first`); `kvrag.reuse.levers`
Order = Literal["retrieval", "canonical", "stored-first"]


@dataclass(frozen=True)
class GenerationOptions:
    """How to answer: how much to decode and how, what to graft, what to deposit afterwards.

    - `max_new_tokens`: the most tokens decoded; `stop`: strings that end the answer (None: the
      prompt layout's own).
    - `graft`: False reads every document and message as text (the text-RAG arm of a comparison).
    - `deposit_missing`: while grafting, deposit afterwards what was read as text, so the next
      prompt that begins alike grafts it (with `graft=False` nothing is deposited); `admit_after`:
      only once the same chain was read as text that many times (1: the first time);
      `deposit_in_background`: on the engine's deposit worker (`engine.deposits`, within its byte
      and time budget), so the answer's end never waits for the deposit.
    - `memo`: answer a recurring question from its verified memo state (documents and a question).
    - `approximate`: move a state deposited at other positions instead of re-reading it
      (`approximate-graft`); `blend` (True, or the share of tokens to recompute): move and partly
      recompute, if the blend gate passed this model. Both only for documents and a question.
    - `temperature` > 0 samples (then `top_k`, `top_p` and `seed` apply); 0 decodes greedily.
    - `order`: the order the documents are read in (`Order`; documents and a question only: a
      conversation's messages keep theirs). Anything but `retrieval` can change answers; a graft
      and a text re-read (`graft=False`) read the same order.
    """

    max_new_tokens: int = 64
    stop: tuple[str, ...] | None = None
    graft: bool = True
    deposit_missing: bool = False
    admit_after: int = 1
    deposit_in_background: bool = False
    memo: bool = True
    approximate: bool = False
    blend: bool | float = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    order: Order = "retrieval"

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InputError("max_new_tokens must be at least 1")
        if not 1 <= self.admit_after <= 1000:
            raise InputError("admit_after is a number of readings from 1 to 1000")
        if self.order not in ("retrieval", "canonical", "stored-first"):
            raise InputError(f"order is retrieval, canonical or stored-first, not {self.order!r}")
        if self.stop is not None and not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        self.sampling  # noqa: B018 - refuses bad sampling settings here, before the first step

    @property
    def sampling(self) -> Sampling:
        try:
            return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)
        except ValueError as e:
            raise InputError(f"bad sampling settings: {' '.join(str(e).split())[:300]}") from e

    @property
    def deposits(self) -> bool:
        """Whether what is read as text is deposited after the answer."""
        return self.deposit_missing and self.graft

    @property
    def exact_only(self) -> bool:
        """Whether every graft this asks for is exact (no moved or blended state)."""
        return not self.approximate and not self.blend

    def stops(self, default: Sequence[str]) -> tuple[str, ...]:
        """The stop strings: the caller's, else `default` (the layout's)."""
        return tuple(self.stop) if self.stop else tuple(default)

    def replace(self, **settings: object) -> "GenerationOptions":
        """These options with `settings` changed (unknown names are an `InputError`)."""
        unknown = sorted(set(settings) - _NAMES)
        if unknown:
            raise InputError(f"unknown generation option {unknown[0]!r}; the options are {', '.join(sorted(_NAMES))}")
        return replace(self, **settings) if settings else self

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


_NAMES = frozenset(f.name for f in fields(GenerationOptions))

#: What kvrag's RAG entry points run with unless told otherwise: the LangChain and LlamaIndex
#: adapters, `kvrag serve` and `kvrag ab`'s default (lazy) policy. A document read as text is
#: deposited after the answer, off its path (`kvrag ab` deposits in line, to time it), so it grafts
#: from the next question on; documents are read in the retriever's order, so answers equal text RAG's.
RAG_DEFAULTS = GenerationOptions(deposit_missing=True, deposit_in_background=True)


class GenerationSettings(TypedDict, total=False):
    """`GenerationOptions`' fields as keyword arguments (see `GenerationOptions`)."""

    max_new_tokens: int
    stop: Sequence[str] | None
    graft: bool
    deposit_missing: bool
    admit_after: int
    deposit_in_background: bool
    memo: bool
    approximate: bool
    blend: bool | float
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    order: Order


def options_of(options: GenerationOptions | None, settings: dict[str, object]) -> GenerationOptions:
    """`options` (default: `GenerationOptions()`) with the keyword `settings` applied over it."""
    base = options if options is not None else GenerationOptions()
    if not isinstance(base, GenerationOptions):
        raise InputError(f"options must be a GenerationOptions, not {type(base).__name__}")
    return base.replace(**settings)
