"""How the next token is chosen: greedy by default; temperature, top-k, top-p and a seed on request.

Sampling never touches what is verified: the first token's logits (and their SHA-256 in the
receipt) are computed before any choice is made, and a seeded choice is reproducible across runs
and processes (a CPU `torch.Generator` seeded with it). A receipt records the settings and the
seed actually used, so any sampled answer can be replayed.
"""

from __future__ import annotations

import secrets

import torch
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Sampling", "Sampler"]


class Sampling(BaseModel):
    """Decoding settings. `temperature=0` (the default) is greedy: the other fields are ignored."""

    model_config = ConfigDict(frozen=True)

    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # 0: no limit
    seed: int | None = Field(default=None, ge=0, lt=2**63)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Chooses tokens for one generation (one random stream, seeded once)."""

    def __init__(self, sampling: Sampling, vocabulary: int) -> None:
        self.vocabulary = vocabulary
        self.sampling = sampling if sampling.greedy or sampling.seed is not None else sampling.model_copy(
            update={"seed": secrets.randbits(63)})
        self._generator: torch.Generator | None = None
        if not self.sampling.greedy:
            self._generator = torch.Generator(device="cpu").manual_seed(int(self.sampling.seed))  # type: ignore[arg-type]

    def pick(self, logits: torch.Tensor) -> int:
        """The next token among the ids the tokenizer has (padded vocabulary rows are never chosen)."""
        logits = logits[: min(self.vocabulary, logits.shape[-1])]
        s = self.sampling
        if s.greedy:
            return int(torch.argmax(logits))
        scores = logits.detach().to("cpu", torch.float32) / s.temperature
        if s.top_k and s.top_k < scores.shape[-1]:
            kth = torch.topk(scores, s.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if s.top_p < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(ordered, dim=-1) - ordered < s.top_p  # the smallest set reaching top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
        return int(torch.multinomial(probs, 1, generator=self._generator))
