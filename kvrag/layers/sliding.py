"""Sliding-window layers (`DynamicSlidingWindowLayer`): a state holds its window's whole tail.

The layer keeps only the last `window - 1` positions plus a running length, so a state records
the tail it held when its segment ended (which may reach back into parent segments), and a graft
puts back the last part's tail and sets the running length to the state's end.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvrag.artifact import LayerEntry
from kvrag.layers.base import LayerCodec, entry_for, set_layer

__all__ = ["SlidingWindow"]


class SlidingWindow(LayerCodec):
    kind = "sliding"
    movable = False  # it holds a window's tail that reaches into parent segments

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

    def graft(self, layer: Any, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], end: int) -> None:
        set_layer(layer, keys[-1], values[-1])
        layer.cumulative_length = end
