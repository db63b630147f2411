"""The codec interface: one per kind of cache layer, so a new kind is one new module.

A codec knows, for its kind of transformers cache layer, which positions a state of a segment
holds (`extract`), whether a manifest's entry for that layer fits the segment (`check`), and how
to set a cache layer from consecutive stored parts (`install`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

from kvrag.artifacts.format import LayerEntry, dtype_name

__all__ = ["LayerCodec", "entry_for"]


class LayerCodec(ABC):
    """How one kind of cache layer is extracted, checked and grafted."""

    kind: str
    window: int | None = None
    #: whether a state's K/V of this layer can be moved to another offset (approximately, opt-in)
    movable: bool = True
    #: whether the first n positions of a state of this layer are a state of its first n tokens
    truncatable: bool = True

    @classmethod
    @abstractmethod
    def describe(cls, layer: Any) -> "LayerCodec | None":
        """A codec for this transformers cache layer, or None if it is not of this kind."""

    @abstractmethod
    def extract(self, layer: Any, start: int, end: int) -> tuple[LayerEntry, torch.Tensor, torch.Tensor]:
        """The entry, keys and values a state of positions [start, end) holds for this layer."""

    @abstractmethod
    def expected_span(self, start: int, end: int) -> tuple[int, int]:
        """(first position, length) a state of positions [start, end) holds for this layer."""

    def refusal(self, entry: LayerEntry, start: int, end: int) -> str | None:
        """Why `entry` cannot be this layer's part of a state of [start, end) (None: it fits)."""
        if entry.kind != self.kind or entry.window != self.window:
            return f"is {entry.kind} (window {entry.window}), the model's is {self.kind} (window {self.window})"
        first, length = self.expected_span(start, end)
        if (entry.first_position, entry.length) != (first, length):
            return f"holds positions {entry.first_position}..{entry.first_position + entry.length}, expected {first}..{first + length}"
        if entry.key_shape[2] != entry.length or entry.value_shape[2] != entry.length:
            return "has tensor shapes that disagree with its length"
        return None

    @abstractmethod
    def install(self, layer: Any, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], end: int) -> None:
        """Set `layer` from consecutive parts' tensors (oldest first); the cache then ends at `end`."""

    @abstractmethod
    def unpad(self, layer: Any, held: tuple[torch.Tensor, torch.Tensor] | None, added: int, padding: int) -> None:
        """Undo the last `padding` of the `added` positions a forward just put in `layer`, which
        held the K/V `held` before it (None: it was empty)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(window={self.window})"


def entry_for(kind: str, window: int | None, first: int, keys: torch.Tensor, values: torch.Tensor) -> LayerEntry:
    return LayerEntry(
        kind=kind,  # type: ignore[arg-type]
        window=window,
        first_position=first,
        length=keys.shape[-2],
        key_shape=tuple(keys.shape),  # type: ignore[arg-type]
        value_shape=tuple(values.shape),  # type: ignore[arg-type]
        dtype=dtype_name(keys.dtype),  # type: ignore[arg-type]
    )


def set_layer(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Put K/V into a transformers cache layer, initializing it first if it never saw a token."""
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
