"""The model runner: the one place that calls the model, picks tokens and hashes logits.

A forward call feeds one segment of ids into a cache and returns the last position's logits;
which ids are fed together is the schedule's business (see `kvrag.schedule`), since floating-point
results depend on it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch

from kvrag.layers import LayerCodec, codecs_for, new_cache
from kvrag.models import LoadedModel
from kvrag.sampling import Sampler, Sampling

__all__ = ["ModelRunner", "logits_sha256"]


def logits_sha256(logits: torch.Tensor) -> str:
    """SHA-256 of a logits tensor's bytes, exactly as computed (dtype kept)."""
    return hashlib.sha256(logits.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


class ModelRunner:
    """Forward calls, greedy picks and fresh caches for one loaded model."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self.codecs: list[LayerCodec] = codecs_for(model.hf_model)
        self._vocab = len(model.tokenizer)
        #: token ids the model can read: rows of its input embedding
        self.vocabulary = int(model.hf_model.get_input_embeddings().num_embeddings)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_cache(self) -> Any:
        return new_cache(self.model.hf_model)

    def forward(self, ids: Sequence[int], cache: Any) -> torch.Tensor:
        """Feed `ids` in one forward call after what `cache` holds; the last position's logits."""
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.model.device)
        with torch.inference_mode():
            out = self.model.hf_model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def forward_at(self, ids: Sequence[int], positions: Sequence[int] | torch.Tensor, cache: Any,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed `ids` at explicit `positions` (not necessarily contiguous), optionally under a
        prepared 4D additive `attention_mask`; the last position's logits (see `kvrag.blend`)."""
        device = self.model.device
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
        position_ids = torch.as_tensor(positions, dtype=torch.long, device=device).reshape(1, -1)
        with torch.inference_mode():
            out = self.model.hf_model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                      past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def sampler(self, sampling: Sampling | None = None) -> Sampler:
        """A token chooser for one generation (greedy unless `sampling` says otherwise)."""
        return Sampler(sampling or Sampling(), self._vocab)
