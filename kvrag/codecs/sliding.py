"""Sliding-window layers (`DynamicSlidingWindowLayer`): a state holds its window's whole tail.

The layer keeps only the last `window - 1` positions plus a running length, so a state records
the tail it held when its segment ended (which may reach back into parent segments), and a graft
puts back the last part's tail and sets the running length to the state's end.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvrag.artifacts.format import LayerEntry
from kvrag.codecs.base import LayerCodec, entry_for, set_layer

__all__ = ["SlidingWindow"]


class SlidingWindow(LayerCodec):
    kind = "sliding"
    movable = False  # it holds a window's tail that reaches into parent segments
    truncatable = False  # ...and only the tail at the state's end

    def __init__(self, window: int) -> None:
        self.window = window

    @classmethod
    def describe(cls, layer: Any) -> "SlidingWindow | None":
        return cls(int(layer.sliding_window)) if isinstance(layer, DynamicSlidingWindowLayer) else None

    def expected_span(self, start: int, end: int) -> tuple[int, int]:
        held = min(end, (self.window or 1) - 1)
        return end - held, held

    def extract(self, layer: Any, start: int, end: int) -> tuple[LayerEntry, torch.Tensor, torch.Tensor]:
        keys, values = layer.keys.contiguous(), layer.values.contiguous()
        return entry_for(self.kind, self.window, end - keys.shape[-2], keys, values), keys, values

    def install(self, layer: Any, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], end: int) -> None:
        set_layer(layer, keys[-1], values[-1])
        layer.cumulative_length = end

    def unpad(self, layer: Any, held: tuple[torch.Tensor, torch.Tensor] | None, added: int, padding: int) -> None:
        # The layer kept the last window - 1 positions, the `added` new ones among them (the
        # runner pads only reads that fit): put back what it held plus the real new positions.
        keep = (self.window or 1) - 1
        new_k = layer.keys[:, :, -added:-padding, :]
        new_v = layer.values[:, :, -added:-padding, :]
        if held is not None:
            new_k, new_v = torch.cat([held[0], new_k], dim=-2), torch.cat([held[1], new_v], dim=-2)
        layer.keys, layer.values = new_k[:, :, -keep:, :], new_v[:, :, -keep:, :]
        layer.cumulative_length -= padding
