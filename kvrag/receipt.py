"""The receipt: what a generation actually did, so that every answer can be audited."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["Mode", "StateUse", "Timings", "Receipt"]

Mode = Literal["exact-graft", "partial-graft", "text-prefill", "approximate-graft", "memo"]


class StateUse(BaseModel):
    """One context segment: where its K/V came from and, if not from its state, why."""

    model_config = ConfigDict(frozen=True)

    key: str
    start: int
    end: int
    source: Literal["graft", "text", "approximate"]
    tier: str | None = None
    reason: str | None = None
    detail: str | None = None
    requested_key: str | None = None


class Timings(BaseModel):
    model_config = ConfigDict(frozen=True)

    restore_ms: float
    prefill_ms: float
    ttft_ms: float
    decode_ms: float
    total_ms: float


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

    @property
    def fallbacks(self) -> list[StateUse]:
        return [s for s in self.states if s.source != "graft"]
