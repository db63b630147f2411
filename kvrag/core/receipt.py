"""The receipt: what a generation actually did, so that every answer can be audited.

A receipt's `mode` follows from where each context segment's K/V came from:

    exact-graft         every segment grafted from its verified state
    partial-graft       some grafted, the rest re-read as text (still exact)
    text-prefill        nothing grafted
    approximate-graft   a state moved to another position (opt-in; `exact` is False)
    memo                a recurring query answered from its verified memo state

A segment re-read as text names its `reason`, one of `Reason`:

    missing       no tier holds the state (or a part of it)
    integrity     stored bytes do not match their digests, do not parse, or were never verified
    signature     the state is unsigned, or signed with another key
    foreign       made by another model or on other hardware, or for another chain or position
    unavailable   a tier failed (down, timed out) while the state was read
    moved         the state was asked for at another position than the one it was deposited at
    graft-off     grafting was turned off for this generation (`graft=False`)
"""

from __future__ import annotations

from typing import Literal, Sequence, get_args

from pydantic import BaseModel, ConfigDict

from kvrag.core.sampling import Sampling
from kvrag.errors import Reason

__all__ = ["Mode", "Reason", "REASONS", "Source", "StateUse", "Timings", "Receipt", "mode_of"]

Mode = Literal["exact-graft", "partial-graft", "text-prefill", "approximate-graft", "memo"]
Source = Literal["graft", "text", "approximate"]
REASONS: tuple[str, ...] = get_args(Reason)


class StateUse(BaseModel):
    """One context segment: where its K/V came from and, if not from its state, why."""

    model_config = ConfigDict(frozen=True)

    key: str
    start: int
    end: int
    source: Source
    tier: str | None = None
    reason: Reason | None = None
    detail: str | None = None
    requested_key: str | None = None


class Timings(BaseModel):
    """Wall times of one answer: `ttft_ms` to the first token, `per_token_ms` for each token after
    it (`decode_ms` over those tokens; 0 for an answer of one token), `total_ms` end to end. Under
    batching (`kvrag serve`) `prefill_ms` includes the wait for the forward that carries the read,
    and `decode_ms` the steps shared with other answers; a streamed answer's `decode_ms` includes
    the time its reader took between tokens."""

    model_config = ConfigDict(frozen=True)

    restore_ms: float
    prefill_ms: float
    ttft_ms: float
    decode_ms: float
    total_ms: float
    per_token_ms: float = 0.0


class Receipt(BaseModel):
    """Mode, states, token counts, timings and the SHA-256 of the first token's logits."""

    model_config = ConfigDict(frozen=True)

    mode: Mode
    exact: bool
    states: list[StateUse]
    tokens_reused: int
    tokens_prefilled: int
    decode_tokens: int
    timings: Timings
    first_token_logits_sha256: str
    model_fingerprint: str
    hardware_fingerprint: str
    #: how tokens were chosen (greedy by default), with the seed actually used when sampled
    sampling: Sampling = Sampling()
    #: with a blend: the share of each moved document's tokens recomputed (None: no blend)
    recompute_ratio: float | None = None
    #: anything else the caller should know (e.g. a blend asked for and refused by the gate)
    notes: list[str] = []
    #: how the prompt was laid out: `chat` or `completion` (kvrag's layouts for documents and a
    #: question, `kvrag.core.prompt`), `chat-template` or `plain-chat` (messages rendered by the
    #: model's chat template, or the fallback for a model without one), `prompt` (a completion
    #: prompt read as given)
    layout: str = ""

    @property
    def fallbacks(self) -> list[StateUse]:
        return [s for s in self.states if s.source != "graft"]


def mode_of(uses: Sequence[StateUse], *, memo: bool = False) -> Mode:
    """The receipt mode that the segments' sources add up to."""
    sources = [u.source for u in uses]
    if memo:
        return "memo"
    if "approximate" in sources:
        return "approximate-graft"
    if "graft" not in sources:
        return "text-prefill"
    return "exact-graft" if all(s == "graft" for s in sources) else "partial-graft"
