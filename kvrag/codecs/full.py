"""Full-attention layers (`DynamicLayer`): a state holds only its own segment's positions.

The layer grows by concatenation, so a segment's K/V are a slice of it and a chain restores by
concatenating its states' slices in order.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers.cache_utils import DynamicLayer

from kvrag.artifacts.format import LayerEntry
from kvrag.codecs.base import LayerCodec, entry_for, set_layer
from kvrag.errors import ModelError
from kvrag.kernels.attention import first_rows

__all__ = ["FullAttention"]


class FullAttention(LayerCodec):
    kind = "full"

    @classmethod
    def describe(cls, layer: Any) -> "FullAttention | None":
        return cls() if type(layer) is DynamicLayer else None

    def expected_span(self, start: int, end: int) -> tuple[int, int]:
        return start, end - start

    def extract(self, layer: Any, start: int, end: int) -> tuple[LayerEntry, torch.Tensor, torch.Tensor]:
        if layer.keys.shape[-2] != end:
            raise ModelError(f"a full-attention layer holds {layer.keys.shape[-2]} positions, expected {end}")
        keys = layer.keys[:, :, start:end, :].contiguous()
        values = layer.values[:, :, start:end, :].contiguous()
        return entry_for(self.kind, None, start, keys, values), keys, values

    def install(self, layer: Any, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], end: int) -> None:
        pieces_k, pieces_v = list(keys), list(values)
        if layer.is_initialized and layer.keys.numel():
            pieces_k.insert(0, layer.keys)
            pieces_v.insert(0, layer.values)
        # Copy-on-graft: a single stored piece is used as it is (never written: every later update
        # concatenates into a new tensor); several are concatenated into a new one.
        set_layer(
            layer,
            pieces_k[0] if len(pieces_k) == 1 else torch.cat(pieces_k, dim=-2),
            pieces_v[0] if len(pieces_v) == 1 else torch.cat(pieces_v, dim=-2),
        )

    def unpad(self, layer: Any, held: tuple[torch.Tensor, torch.Tensor] | None, added: int, padding: int) -> None:
        kept = layer.keys.shape[-2] - padding
        layer.keys, layer.values = first_rows(layer.keys, kept), first_rows(layer.values, kept)
