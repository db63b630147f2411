"""Reading a segment out of a transformers `DynamicCache`, and building a cache from stored parts.

A cache is a list of layers. Full-attention layers (`DynamicLayer`) grow by concatenation, so a
segment's K/V are a slice of them and a chain restores by concatenating its states. Sliding-window
layers (`DynamicSlidingWindowLayer`) keep only the last `window - 1` tokens plus a running length,
so a state records the whole window it held and the restore sets that running length back.
Restores are copy-on-graft by construction: every later `update` concatenates into new tensors, so
the tensors handed in (often views over stored bytes) are never written.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvrag.artifact import LayerEntry, dtype_name, tensor_names
from kvrag.errors import ModelError

# transformers 5.23 announces a rename of `past_key_values` to `cache`, but its models' forward
# signatures still take `past_key_values` (a `cache=` argument is silently ignored there).
warnings.filterwarnings("ignore", message=r".*`past_key_values` is deprecated", category=FutureWarning)

__all__ = ["LayerSpec", "layer_specs", "new_cache", "extract_segment", "StatePart", "append_parts"]


@dataclass(frozen=True)
class LayerSpec:
    kind: str  # "full" | "sliding"
    window: int | None


def new_cache(hf_model: Any) -> DynamicCache:
    return DynamicCache(config=hf_model.config)


def layer_specs(hf_model: Any) -> list[LayerSpec]:
    """The kinds of cache layer the model uses; kvrag refuses models whose layers it cannot graft."""
    specs = []
    for layer in new_cache(hf_model).layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            specs.append(LayerSpec("sliding", int(layer.sliding_window)))
        elif type(layer) is DynamicLayer:
            specs.append(LayerSpec("full", None))
        else:
            raise ModelError(f"kvrag cannot graft cache layers of type {type(layer).__name__} yet")
    if not specs:  # caches built lazily: one full layer per decoder layer
        config = hf_model.config.get_text_config(decoder=True)
        count = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer")
        specs = [LayerSpec("full", None)] * int(count)
    return specs


def extract_segment(cache: DynamicCache, start: int, end: int) -> tuple[list[LayerEntry], dict[str, torch.Tensor]]:
    """The layers' entries and tensors for the segment of positions [start, end) just prefilled."""
    entries: list[LayerEntry] = []
    tensors: dict[str, torch.Tensor] = {}
    for index, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values
        if isinstance(layer, DynamicSlidingWindowLayer):
            held = keys.shape[-2]
            kind, window, first = "sliding", int(layer.sliding_window), end - held
        else:
            if keys.shape[-2] != end:
                raise ModelError(f"layer {index} holds {keys.shape[-2]} positions, expected {end}")
            keys, values = keys[:, :, start:end, :], values[:, :, start:end, :]
            kind, window, first = "full", None, start
        key_name, value_name = tensor_names(index)
        tensors[key_name] = keys.contiguous()
        tensors[value_name] = values.contiguous()
        entries.append(
            LayerEntry(
                kind=kind,
                window=window,
                first_position=first,
                length=keys.shape[-2],
                key_shape=tuple(keys.shape),
                value_shape=tuple(values.shape),
                dtype=dtype_name(keys.dtype),
            )
        )
    return entries, tensors


@dataclass(frozen=True)
class StatePart:
    """A verified state ready to graft: its layer entries and tensors, and its position range."""

    start: int
    end: int
    layers: Sequence[LayerEntry]
    tensors: dict[str, torch.Tensor]


def append_parts(cache: DynamicCache, parts: Sequence[StatePart], device: torch.device) -> None:
    """Graft consecutive states onto `cache`, which must hold exactly positions [0, parts[0].start)."""
    if not parts:
        return
    end = parts[-1].end
    for index, layer in enumerate(cache.layers):
        key_name, value_name = tensor_names(index)
        if isinstance(layer, DynamicSlidingWindowLayer):
            keys = parts[-1].tensors[key_name].to(device)
            values = parts[-1].tensors[value_name].to(device)
        else:
            pieces_k = [p.tensors[key_name].to(device) for p in parts]
            pieces_v = [p.tensors[value_name].to(device) for p in parts]
            if layer.is_initialized and layer.keys.numel():
                pieces_k.insert(0, layer.keys)
                pieces_v.insert(0, layer.values)
            keys = pieces_k[0] if len(pieces_k) == 1 else torch.cat(pieces_k, dim=-2)
            values = pieces_v[0] if len(pieces_v) == 1 else torch.cat(pieces_v, dim=-2)
        if not layer.is_initialized:
            layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = end
