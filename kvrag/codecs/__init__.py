"""A transformers cache as a list of layers, each handled by the codec of its kind.

`codecs_for(model)` says how each of a model's cache layers is extracted, checked and grafted
(`kvrag.codecs.full`, `kvrag.codecs.sliding`); `extract` reads a just-prefilled segment out of a
cache; `install` sets a cache from stored parts, at once or (`GraftCache.defer`) each layer when
the forward first reaches it. A new kind of layer is one new codec module, added to `CODECS`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvrag.artifacts.format import LayerEntry, tensor_names
from kvrag.codecs.base import LayerCodec
from kvrag.codecs.full import FullAttention
from kvrag.codecs.ready import Lease, ReadyBuffers
from kvrag.codecs.sliding import SlidingWindow
from kvrag.errors import ModelError
from kvrag.kernels.attention import INVARIANT, KEY_BLOCK, buffer_of, first_rows, key_value_buffer

__all__ = ["LayerCodec", "FullAttention", "SlidingWindow", "CODECS", "StatePart", "GraftCache", "ReadyBuffers",
           "new_cache", "codecs_for", "extract", "install", "truncated"]

CODECS: tuple[type[LayerCodec], ...] = (FullAttention, SlidingWindow)


@dataclass(frozen=True)
class StatePart:
    """A checked state ready to graft: its layer entries and tensors, and its position range."""

    start: int
    end: int
    layers: Sequence[LayerEntry]
    tensors: dict[str, torch.Tensor]
    #: the immutable bytes `tensors` were decoded from (a tier's payload), if they may be grafted
    #: again from the same object: a kept whole-block buffer of them may serve (`ReadyBuffers`)
    source: Any = field(default=None, compare=False, repr=False)


class GraftCache(DynamicCache):
    """A `DynamicCache` whose grafted layers may be installed late: `defer(i, install)` runs
    `install()` when the forward first touches layer i (its update, length or mask sizes), so a
    streamed state's later layers can still be arriving while the forward computes earlier ones.
    `settle()` runs whatever is still deferred.

    `in_place` (the invariant kernel): a full-attention layer's K/V are views of a buffer of whole
    key blocks with room after them, so a read appends in place (no copy of the whole layer per
    call, as concatenation makes) and the kernel reads the padded blocks without copying them."""

    def __init__(self, *, in_place: bool = False, ready: ReadyBuffers | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._deferred: dict[int, Any] = {}
        self._in_place = in_place
        #: each in-place layer's buffers (held here: a view made in inference mode keeps no base)
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._ready_pool = ready if in_place else None
        self._lease: Lease | None = None

    def lease_ready(self, parts: Sequence[StatePart]) -> bool:
        """Take the kept whole-block buffers of `parts` (grafted from position 0 into this empty
        cache), so their layers are installed without a copy and a layer's new buffer is kept."""
        if self._ready_pool is None or self._lease is not None or not parts or parts[0].start != 0:
            return False
        if any(layer.is_initialized for layer in self.layers):
            return False
        self._lease = self._ready_pool.lease([p.source for p in parts], [(p.start, p.end) for p in parts])
        if self._lease is not None:
            weakref.finalize(self, self._lease.give_back)
        return self._lease is not None

    def install_ready(self, layer_idx: int, end: int, like: torch.Tensor) -> bool:
        """Install layer `layer_idx` (positions [0, end), shaped and typed like `like`) from its kept
        buffers, if it has them; False: install it as usual (its next buffer is then kept)."""
        held = self._lease.get(layer_idx) if self._lease is not None else None
        layer = self.layers[layer_idx]
        if held is None or type(layer) is not DynamicLayer:
            return False
        keys, values = held
        if keys.shape[-2] < end or keys.shape[:-2] != like.shape[:-2] or keys.dtype != like.dtype:
            return False
        view_k, view_v = first_rows(keys, end), first_rows(values, end)
        with torch.inference_mode():  # the last question's rows after the state: zeros, as a fresh buffer's are
            keys[:, :, end:].zero_()
            values[:, :, end:].zero_()
        if not layer.is_initialized:
            layer.lazy_initialization(view_k, view_v)
        layer.keys, layer.values = view_k, view_v
        self._buffers[layer_idx] = keys, values
        return True

    def release(self) -> None:
        """This cache is done: its kept buffers may serve another question."""
        if self._lease is not None:
            self._lease.give_back()

    def defer(self, layer_idx: int, install: Any) -> None:
        self._deferred[layer_idx] = install

    def _ready(self, layer_idx: int) -> None:
        if self._deferred:
            install = self._deferred.pop(layer_idx, None)
            if install is not None:
                install()

    def settle(self) -> None:
        for layer_idx in sorted(self._deferred):
            self._ready(layer_idx)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        self._ready(layer_idx)
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if not self._in_place or type(layer) is not DynamicLayer:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        held, added = (layer.keys.shape[-2] if layer.keys.dim() == 4 else 0), key_states.shape[-2]
        keys, values = self._buffers.get(layer_idx, (None, None))
        if not (held and _leads(layer.keys, keys) and _leads(layer.values, values) and held + added <= keys.shape[-2]):
            rows = -(-(held + added) // KEY_BLOCK) * KEY_BLOCK  # whole blocks; a later block is a new buffer
            spare = self._lease.spare(key_states, rows) if held and self._lease is not None else None
            if spare is not None:  # memory a gone state's buffers left: no fresh pages
                keys, values = spare
                # its rows past ours held another question's K/V: zeros, as a fresh buffer's are
                keys[:, :, held + added :].zero_()
                values[:, :, held + added :].zero_()
            else:
                keys = key_value_buffer(key_states, rows, written=held + added)
                values = key_value_buffer(value_states, rows, written=held + added)
            if held:
                keys[:, :, :held], values[:, :, :held] = layer.keys, layer.values
            self._buffers[layer_idx] = keys, values
            if held and self._lease is not None:  # its first rows are the leased parts' own: kept for the next
                self._lease.keep(layer_idx, keys, values)
        keys[:, :, held : held + added], values[:, :, held : held + added] = key_states, value_states
        layer.keys, layer.values = first_rows(keys, held + added), first_rows(values, held + added)
        return layer.keys, layer.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._ready(layer_idx)
        return super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: Any, layer_idx: int) -> tuple[int, int]:
        self._ready(layer_idx)
        return super().get_mask_sizes(query_length, layer_idx)


def _leads(states: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    """Whether `states` is the leading rows of `buffer` (this cache's own: never another's)."""
    return buffer is not None and buffer_of(states) is buffer


def new_cache(hf_model: Any, ready: ReadyBuffers | None = None) -> GraftCache:
    """A cache for one forward run; `ready`: kept whole-block buffers its grafts may lease."""
    return GraftCache(config=hf_model.config, in_place=hf_model.config._attn_implementation == INVARIANT, ready=ready)


def codecs_for(hf_model: Any) -> list[LayerCodec]:
    """One codec per cache layer of the model; a layer of a kind kvrag cannot graft is a `ModelError`."""
    codecs: list[LayerCodec] = []
    for layer in new_cache(hf_model).layers:
        codec = next((c for kind in CODECS if (c := kind.describe(layer)) is not None), None)
        if codec is None:
            raise ModelError(f"kvrag cannot graft cache layers of type {type(layer).__name__} yet")
        codecs.append(codec)
    if not codecs:  # caches built lazily: one full layer per decoder layer
        config = hf_model.config.get_text_config(decoder=True)
        count = getattr(config, "num_hidden_layers", None) or config.n_layer
        codecs = [FullAttention() for _ in range(int(count))]
    return codecs


def extract(codecs: Sequence[LayerCodec], cache: DynamicCache, start: int, end: int) -> tuple[list[LayerEntry], dict[str, torch.Tensor]]:
    """The layers' entries and tensors for the segment of positions [start, end) just prefilled."""
    entries: list[LayerEntry] = []
    tensors: dict[str, torch.Tensor] = {}
    for index, (codec, layer) in enumerate(zip(codecs, cache.layers)):
        entry, keys, values = codec.extract(layer, start, end)
        key_name, value_name = tensor_names(index)
        tensors[key_name], tensors[value_name] = keys, values
        entries.append(entry)
    return entries, tensors


def install(codecs: Sequence[LayerCodec], cache: DynamicCache, parts: Sequence[StatePart], device: torch.device, *,
            deferred: bool = False) -> None:
    """Install consecutive parts onto `cache`, which must hold exactly positions [0, parts[0].start);
    `deferred` (a `GraftCache`): each layer when the forward first reaches it."""
    if not parts:
        return
    ready = isinstance(cache, GraftCache) and cache.lease_ready(parts)
    for index, (codec, layer) in enumerate(zip(codecs, cache.layers)):
        key_name, value_name = tensor_names(index)

        def one(codec: LayerCodec = codec, layer: Any = layer, key_name: str = key_name, value_name: str = value_name,
                index: int = index) -> None:
            if ready and isinstance(codec, FullAttention) and cache.install_ready(
                    index, parts[-1].end, parts[0].tensors[key_name]):
                return
            codec.install(
                layer,
                [p.tensors[key_name].to(device) for p in parts],
                [p.tensors[value_name].to(device) for p in parts],
                parts[-1].end,
            )

        if deferred and isinstance(cache, GraftCache):
            cache.defer(index, one)
        else:
            one()


def truncated(codecs: Sequence[LayerCodec], part: StatePart, end: int) -> StatePart:
    """`part` cut to positions [part.start, end): exact only under the invariant kernel, where a
    position's K/V do not depend on what follows it. Every layer must be `truncatable`."""
    if end == part.end:
        return part
    if not all(codec.truncatable for codec in codecs) or not part.start < end < part.end:
        raise ModelError(f"cannot cut a state of {part.start}..{part.end} at {end} for this model's layers")
    keep = end - part.start
    tensors = {name: tensor[:, :, :keep, :] for name, tensor in part.tensors.items()}
    return StatePart(part.start, end, part.layers, tensors)
