"""A schedule-invariant attention kernel, `attn="invariant"`: each query row's result has the same
bits however the prompt was split into forward calls.

With plain sdpa, a graft equals a fresh computation only *in the same segments*: the CPU flash
kernel reduces over keys in blocks of 512 counted from the call's first key, its last block is as
long as the call makes it (a product over fewer keys rounds otherwise than the same keys followed
by zeros), and an elementwise `exp` takes a scalar tail that
rounds otherwise than its vector path. So one pass over a whole prompt and the same prompt read in
two parts differ in the last bits. This kernel calls the same flash kernel (torch's
`scaled_dot_product_attention`, in the model's dtype) on a layout that fixes every block:

- keys are padded to whole blocks of `KEY_BLOCK` (512, the flash kernel's key block) aligned at
  absolute position 0 (a sliding-window layer, which holds a later tail, is padded at the front
  too); padded keys are masked, so each of a row's key blocks holds the same keys at the same
  places in every call, and blocks a row cannot see change nothing (their weights are exact zeros);
- query rows are read in chunks of at most `QUERY_CHUNK`, each padded with copies of its last
  row so that no query block of the flash kernel holds fewer than `MIN_QUERY_ROWS` rows (it splits
  rows into blocks of 32, 64 or 256, and a block of fewer than `MIN_QUERY_ROWS` rows rounds
  otherwise than the same rows in a full block; `tests/unit/test_invariant.py` tries the counts),
  each chunk attending to the whole key blocks its rows can see (so a long read does not
  weigh every key for every row);
- a single query row (a decoding step) would be a chunk of that row repeated; instead the query
  heads that share a key head are the rows of one chunk (zeros after them): the same block shape,
  so the same bits, in one block per key head instead of one per query head;
- a first read of a prompt (no cache, plain causal mask) is one causal call on the padded layout:
  the flash kernel skips the blocks past each row itself, and the blocks it does weigh are the ones
  above.

The linear layers around attention depend on the row count too: a CPU matrix product gave a row
other bits among fewer than ~12 rows than among more (float32). Under this kernel every linear layer
is oneDNN's product over a reordered weight, fed at least `ROW_BLOCK` rows (`kvrag.kernels.linear`).
Decoding steps are one row, as in a stock `model.generate`.

`register()` registers the kernel with transformers under the name `invariant` (an attention
function and its mask), so a stock `AutoModelForCausalLM.from_pretrained(..., attn_implementation="invariant")`
after it, its linear layers made invariant with
`kvrag.kernels.linear.make_linear_invariant(model)`, computes the same bits as kvrag does.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Sequence

import torch

from kvrag.errors import ModelError

__all__ = ["INVARIANT", "KEY_BLOCK", "QUERY_BLOCK", "MIN_QUERY_ROWS", "QUERY_CHUNK", "MIN_FORWARD_ROWS",
           "invariant_attention", "query_rows", "key_value_buffer", "buffer_of", "register", "Packing", "PACKING"]

INVARIANT = "invariant"
#: the keyword argument of a model forward that packs several sequences' rows (a `Packing`)
PACKING = "kvrag_packing"
#: keys are padded to whole blocks of this many, aligned at absolute position 0 (the CPU flash
#: kernel's key block: it reduces over keys in blocks of 512 once a call holds 512 or more)
KEY_BLOCK = 512
#: the flash kernel splits a call's query rows into blocks of a multiple of this (32, 64 or 256)
QUERY_BLOCK = 32
#: no query block of a call holds fewer rows than this (padded with copies of the last row)
MIN_QUERY_ROWS = 16
#: a read's query rows are taken in chunks of at most this many
QUERY_CHUNK = 512
#: prompt reads shorter than this are padded (see `ModelRunner.forward`)
MIN_FORWARD_ROWS = 16

_sdpa = torch.nn.functional.scaled_dot_product_attention


def _absolute_last(kwargs: dict[str, Any], kv_len: int) -> int:
    """The absolute position of the last query (keys end there too, whatever the layer holds)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        return kv_len - 1
    return int(position_ids.reshape(-1)[-1])


def invariant_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: `query` [b, h, q, d], `key`/`value` [b, h_kv, kv, d],
    `attention_mask` boolean (True: may attend), additive, or None (causal), [b, 1, q, kv];
    returns [b, q, h, d]. With `kvrag_packing` (a model forward's keyword argument, which
    transformers hands every layer's attention), the rows are several sequences' (see `Packing`)."""
    packing: Packing | None = kwargs.pop(PACKING, None)
    if packing is not None:
        return packing.attend(module, query, scaling, softcap, kwargs), None
    return _attention(module, query, key, value, attention_mask, scaling, softcap, kwargs), None


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None, softcap: float | None,
               kwargs: dict[str, Any]) -> torch.Tensor:
    if softcap is not None:
        raise ModelError("the invariant kernel has no attention logit soft-capping (Gemma 2); load the model "
                         "with attn='sdpa'")
    batch, heads, q_len, head_dim = query.shape
    kv_len = key.shape[-2]
    gqa = heads != key.shape[1]
    last = _absolute_last(kwargs, kv_len)
    k_start = max(0, last - kv_len + 1)
    q_start = max(0, last - q_len + 1)

    if attention_mask is None and k_start == 0 and q_len == kv_len:  # a first read, plain causal
        total = _whole(q_len, KEY_BLOCK)
        out = _sdpa(_pad(query, 0, total), _pad(key, 0, total), _pad(value, 0, total), is_causal=True,
                    scale=scaling, enable_gqa=gqa)[:, :, :q_len]
        return out.transpose(1, 2).contiguous()

    plan = _plan(attention_mask, kwargs.get("position_ids"), batch, q_len, kv_len, q_start, k_start, query)
    keys, values = _pad(key, plan.k_front, plan.k_total), _pad(value, plan.k_front, plan.k_total)
    if q_len == 1 and heads // key.shape[1] <= MIN_QUERY_ROWS:
        return _one_row(query, keys, values, plan.chunks[0], scaling)
    out = query.new_empty((batch, heads, q_len, head_dim))
    for first, end, rows, lo, hi, mask in plan.chunks:
        part = _sdpa(query[:, :, rows], keys[:, :, lo:hi], values[:, :, lo:hi], attn_mask=mask, scale=scaling,
                     enable_gqa=gqa)
        out[:, :, first:end] = part[:, :, : end - first]
    return out.transpose(1, 2).contiguous()


class Packing:
    """One forward call over several sequences' rows side by side (`spans`: each sequence's rows in
    the call), each attending only over its own keys at its own positions. A packing cache hands
    each layer's per-sequence keys and values to `hold`; attention then computes every sequence's
    rows exactly as a forward over that sequence alone would (this kernel, a causal view)."""

    def __init__(self, spans: Sequence[tuple[int, int]]) -> None:
        self.spans = list(spans)
        self._held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._positions: list[torch.Tensor] | None = None

    def hold(self, layer_idx: int, keys_values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._held[layer_idx] = keys_values

    def attend(self, module: Any, query: torch.Tensor, scaling: float | None, softcap: float | None,
               kwargs: dict[str, Any]) -> torch.Tensor:
        held = self._held.pop(module.layer_idx)
        position_ids = kwargs.pop("position_ids")
        if self._positions is None:  # one tensor per sequence for every layer: its plan is made once
            self._positions = [position_ids[..., a:b] for a, b in self.spans]
        parts = [_attention(module, query[:, :, a:b], key, value, None, scaling, softcap,
                            {**kwargs, "position_ids": positions})
                 for (a, b), (key, value), positions in zip(self.spans, held, self._positions)]
        return torch.cat(parts, dim=1)


def _one_row(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, chunk: tuple[Any, ...],
             scaling: float | None) -> torch.Tensor:
    """One query row's attention (a decoding step), [b, 1, h, d]. Its chunk is that row repeated
    to `MIN_QUERY_ROWS` rows under one mask row; here the query heads that share a key head are
    those rows instead, padded with zeros (a row's bits depend on how many rows its block holds,
    not on what they hold), so one block per key head computes what a block per query head did."""
    batch, heads, _, head_dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    _, _, rows, lo, hi, mask = chunk
    grouped = torch.nn.functional.pad(query.reshape(batch, kv_heads, group, head_dim), (0, 0, 0, rows.numel() - group))
    out = _sdpa(grouped, keys[:, :, lo:hi], values[:, :, lo:hi], attn_mask=mask, scale=scaling)
    return out[:, :, :group].reshape(batch, 1, heads, head_dim)


def query_rows(n: int) -> int:
    """How many rows a chunk of `n` query rows is computed as: at least `MIN_QUERY_ROWS`, and so that
    its last block (of any multiple of `QUERY_BLOCK` rows) holds none or at least `MIN_QUERY_ROWS`."""
    rows = max(n, MIN_QUERY_ROWS)
    tail = rows % QUERY_BLOCK
    return rows + (MIN_QUERY_ROWS - tail if 0 < tail < MIN_QUERY_ROWS else 0)


class _Plan:
    """What every layer of one forward does alike: the key padding, and per query chunk its rows,
    key span and additive mask (as sdpa makes from a boolean one). Made once per mask and shape."""

    def __init__(self, visible: torch.Tensor, kv_len: int, k_start: int, dtype: torch.dtype) -> None:
        q_len = visible.shape[-2]
        self.k_front = k_start % KEY_BLOCK
        self.k_total = _whole(self.k_front + kv_len, KEY_BLOCK)
        visible = torch.nn.functional.pad(visible, (self.k_front, self.k_total - self.k_front - kv_len))
        self.chunks = []
        for first in range(0, q_len, QUERY_CHUNK):
            end = min(q_len, first + QUERY_CHUNK)
            rows = torch.arange(first, first + query_rows(end - first), device=visible.device).clamp_(max=end - 1)
            chunk_visible = visible[:, :, rows]
            lo, hi = _key_span(chunk_visible, self.k_total)
            mask = torch.zeros(chunk_visible[..., lo:hi].shape, dtype=dtype, device=visible.device)
            mask.masked_fill_(chunk_visible[..., lo:hi].logical_not(), float("-inf"))
            self.chunks.append((first, end, rows, lo, hi, mask))


#: each thread's plans for the forward it is in, by the mask (or positions) they were made for:
#: a plan lives as long as that tensor does (transformers drops it when the forward ends); a packed
#: forward holds one per sequence
_PLANS = threading.local()
_PLANS_KEPT = 128


def _plan(mask: torch.Tensor | None, position_ids: torch.Tensor | None, batch: int, q_len: int, kv_len: int,
          q_start: int, k_start: int, query: torch.Tensor) -> _Plan:
    anchor = mask if mask is not None else position_ids
    key = (id(anchor), mask is None, batch, q_len, kv_len, q_start, k_start, query.dtype, query.device)
    made: dict[tuple[Any, ...], tuple[Any, _Plan]] | None = getattr(_PLANS, "made", None)
    if made is None:
        made = _PLANS.made = {}
    found = made.get(key) if anchor is not None else None
    if found is not None and found[0]() is anchor:
        return found[1]
    plan = _Plan(_visibility(mask, batch, q_len, kv_len, q_start, k_start, query.device), kv_len, k_start, query.dtype)
    if anchor is not None:
        made[key] = (weakref.ref(anchor, lambda _, made=made, key=key: made.pop(key, None)), plan)
        while len(made) > _PLANS_KEPT:
            made.pop(next(iter(made)))
    return plan


def _whole(n: int, block: int) -> int:
    return max(block, -(-n // block) * block)


def _key_span(visible: torch.Tensor, k_total: int) -> tuple[int, int]:
    """The whole KEY_BLOCKs holding every key the given rows can see (blocks outside add nothing)."""
    where = torch.nonzero(visible.reshape(-1, k_total).any(dim=0))
    if where.numel() == 0:
        return 0, KEY_BLOCK
    first, last = int(where[0]), int(where[-1])
    return first // KEY_BLOCK * KEY_BLOCK, (last // KEY_BLOCK + 1) * KEY_BLOCK


#: the attribute by which a view made by `first_rows` carries its `key_value_buffer` to the kernel
_BUFFER = "_kvrag_key_value_buffer"
#: the attribute that marks a `key_value_buffer` itself (not a reference to itself: no cycle)
_WHOLE = "_kvrag_whole_buffer"


def key_value_buffer(like: torch.Tensor, rows: int, *, written: int = 0) -> torch.Tensor:
    """A tensor shaped like `like` ([b, h, n, d]) with `rows` positions, whose leading views
    (`first_rows`) this kernel reads as already padded: a cache that keeps its K/V as such views
    (rows past a view finite: zeros, or positions read and dropped) spares the kernel a padded copy
    of every layer. The first `written` rows are left for the caller to fill, the rest are zeros."""
    buffer = like.new_empty((*like.shape[:-2], rows, like.shape[-1]))
    buffer[..., written:, :].zero_()
    setattr(buffer, _WHOLE, True)
    return buffer


def first_rows(states: torch.Tensor, count: int) -> torch.Tensor:
    """`states`' first `count` positions ([b, h, n, d]); of a `key_value_buffer` or a view of one, a
    view that carries the buffer to the kernel (held by the view itself: no registry, no address)."""
    buffer = buffer_of(states)
    if buffer is None:
        return states[:, :, :count]
    view = buffer[:, :, :count]
    setattr(view, _BUFFER, buffer)
    return view


def buffer_of(states: torch.Tensor) -> torch.Tensor | None:
    """The `key_value_buffer` whose leading rows `states` is (made by it or `first_rows`), if any."""
    buffer = states if getattr(states, _WHOLE, False) else getattr(states, _BUFFER, None)
    if buffer is None or states.dim() != 4 or states.data_ptr() != buffer.data_ptr():
        return None
    if states.stride() != buffer.stride() or states.shape[:-2] != buffer.shape[:-2]:
        return None
    return buffer


def _pad(states: torch.Tensor, front: int, total: int) -> torch.Tensor:
    back = total - front - states.shape[-2]
    if front == 0 and back == 0:
        return states
    buffer = buffer_of(states) if front == 0 else None
    if buffer is not None and buffer.shape[-2] >= total:
        return buffer[..., :total, :]  # the rows past `states` are masked, and finite
    return torch.nn.functional.pad(states, (0, 0, front, back))


def _visibility(mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, q_start: int, k_start: int,
                device: torch.device) -> torch.Tensor:
    """A boolean [b, 1, q, kv] mask (True: may attend) from whatever transformers passed."""
    if mask is None:  # causal by absolute position
        q_pos = torch.arange(q_start, q_start + q_len, device=device)[:, None]
        k_pos = torch.arange(k_start, k_start + kv_len, device=device)[None, :]
        return (k_pos <= q_pos).expand(batch, 1, q_len, kv_len)
    if mask.dtype == torch.bool:
        visible = mask
    else:  # additive: 0 where visible, a large negative number (or -inf) where not
        visible = mask > torch.finfo(mask.dtype).min / 2
    return visible[..., -kv_len:].expand(batch, 1, q_len, kv_len)


_registered = False


def register() -> None:
    """Register the kernel with transformers as `invariant`, with sdpa's mask (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(INVARIANT, invariant_attention)
    AttentionMaskInterface.register(INVARIANT, sdpa_mask)
    _registered = True
