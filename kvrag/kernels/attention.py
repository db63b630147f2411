"""A schedule-invariant attention kernel, `attn="invariant"`: each query row's result has the same
bits however the prompt was split into forward calls.

With sdpa or eager, a graft equals a fresh computation only *in the same segments*: the reduction
over keys is blocked according to how many keys a call holds, so one pass over a whole prompt and
the same prompt read in two parts differ in the last bits. Here a row's arithmetic does not depend
on what else the call holds:

- scores are one matrix product of the row's query with the keys, in float32 whatever the model's
  dtype; a position the row may not see scores the float32 minimum, so its weight is an exact zero,
  and the softmax is taken against the row's maximum (a max has no rounding);
- the weighted sum and the softmax's denominator (a column of ones beside the values) are summed
  over keys in blocks of `KEY_BLOCK` aligned at absolute position 0, each block one product of the
  same shape, added in key order: a CPU product's reduction depends on how many keys it holds
  (measured: 256 keys gave other bits than the same keys followed by zeros), a fixed block's does
  not, and blocks a row cannot see add exact zeros;
- every product has at least `MIN_QUERY_ROWS` query rows (a CPU product's row bits depend on the
  row count below ~12 rows), and key spans are whole blocks, so an elementwise `exp` runs its vector
  path for every element (its scalar tail rounds differently).

The linear layers around attention depend on the row count too: a CPU matrix product gave a row
other bits among fewer than ~12 rows than among more (float32). Under this kernel every linear layer
is computed with at least `ROW_BLOCK` rows (`kvrag.kernels.linear`). Decoding steps are one row,
as in a stock `model.generate`.

The kernel is registered with transformers under the name `invariant` (an attention function and
its mask), so a stock `AutoModelForCausalLM.from_pretrained(..., attn_implementation="invariant")`
after `import kvrag`, its linear layers made invariant with
`kvrag.kernels.linear.make_linear_invariant(model)`, computes the same bits as kvrag does.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["INVARIANT", "KEY_BLOCK", "MIN_QUERY_ROWS", "MIN_FORWARD_ROWS", "invariant_attention", "register"]

INVARIANT = "invariant"
#: keys are weighted and summed in blocks of this many, aligned at absolute position 0
KEY_BLOCK = 256
#: a call's query rows per key-value head are padded to at least this many
MIN_QUERY_ROWS = 16
#: prompt reads shorter than this are padded (see `ModelRunner.forward`)
MIN_FORWARD_ROWS = 16
#: scores held at once, in float32 elements (query chunks are sized to fit)
_SCORES_BUDGET = 1 << 21

_MASKED = torch.finfo(torch.float32).min


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
    `attention_mask` boolean (True: may attend) or additive, [b, 1, q, kv]; returns [b, q, h, d]."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[-2]
    groups = heads // kv_heads
    scale = float(scaling) if scaling is not None else head_dim**-0.5
    last = _absolute_last(kwargs, kv_len)
    k_start = max(0, last - kv_len + 1)
    q_start = max(0, last - q_len + 1)
    visible = _visibility(attention_mask, batch, q_len, kv_len, q_start, k_start, query.device)

    # Keys aligned at absolute multiples of KEY_BLOCK: padded at the front (a sliding layer holds a
    # later tail) and the back with keys nobody sees; values get a column of ones (the denominator).
    k_front = k_start % KEY_BLOCK
    k_total = -(-(k_front + kv_len) // KEY_BLOCK) * KEY_BLOCK
    k = _pad_rows(key.float(), k_front, k_total)
    v = _pad_rows(torch.cat([value.float(), value.new_ones((*value.shape[:-1], 1), dtype=torch.float32)], -1),
                  k_front, k_total)
    visible = torch.nn.functional.pad(visible, (k_front, k_total - k_front - kv_len))
    rows = max(q_len, MIN_QUERY_ROWS)  # padded rows see nothing (uniform weights: finite), thrown away
    q = query.float() * scale  # scaled once, row by row
    if rows > q_len:
        q = torch.nn.functional.pad(q, (0, 0, 0, rows - q_len))
        visible = torch.nn.functional.pad(visible, (0, 0, 0, rows - q_len))

    out = query.new_empty((batch, q_len, heads, head_dim), dtype=torch.float32)
    chunk = max(MIN_QUERY_ROWS, _SCORES_BUDGET // (heads * k_total) // MIN_QUERY_ROWS * MIN_QUERY_ROWS)
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        if rows - r1 < MIN_QUERY_ROWS:  # never leave a short last chunk
            r1 = rows
        lo, hi = _key_range(visible[:, :, r0:r1], k_total)
        qg = q[:, :, r0:r1].reshape(batch, kv_heads, groups * (r1 - r0), head_dim)
        scores = torch.matmul(qg, k[:, :, lo:hi].transpose(-1, -2))
        scores = scores.view(batch, kv_heads, groups, r1 - r0, hi - lo)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        chunk_visible = visible[:, :, None, r0:r1, lo:hi]
        if not bool(chunk_visible.all()):
            scores = scores.masked_fill(~chunk_visible, _MASKED)
        weights = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
        weights = weights.view(batch, kv_heads, groups * (r1 - r0), hi - lo)
        summed = None
        for b0 in range(lo, hi, KEY_BLOCK):  # in key order, each block one product of the same shape
            block = torch.matmul(weights[..., b0 - lo : b0 - lo + KEY_BLOCK], v[:, :, b0 : b0 + KEY_BLOCK])
            summed = block if summed is None else summed.add_(block)
        summed = summed.view(batch, kv_heads, groups, r1 - r0, head_dim + 1)
        kept = min(r1, q_len) - r0
        if kept > 0:
            part = summed[:, :, :, :kept]
            out[:, r0 : r0 + kept] = (part[..., :head_dim] / part[..., head_dim:]).permute(0, 3, 1, 2, 4).reshape(
                batch, kept, heads, head_dim)
    return out.to(query.dtype), None


def _key_range(visible: torch.Tensor, k_total: int) -> tuple[int, int]:
    """The KEY_BLOCK-aligned span of keys the given rows can see (blocks outside it add exact zeros)."""
    seen = visible.any(dim=-2).reshape(-1, k_total).any(dim=0)
    where = torch.nonzero(seen)
    if where.numel() == 0:
        return 0, KEY_BLOCK
    first, last = int(where[0]), int(where[-1])
    return first // KEY_BLOCK * KEY_BLOCK, (last // KEY_BLOCK + 1) * KEY_BLOCK


def _pad_rows(states: torch.Tensor, front: int, total: int) -> torch.Tensor:
    back = total - front - states.shape[-2]
    if front == 0 and back == 0:
        return states
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
def _invariant_mask(*args: Any, **kwargs: Any) -> Any:
    """The boolean mask sdpa gets, never skipped (the kernel has no `is_causal` shortcut)."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


_registered = False


def register() -> None:
    """Register the kernel and its mask with transformers as `invariant` (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(INVARIANT, invariant_attention)
    AttentionMaskInterface.register(INVARIANT, _invariant_mask)
    _registered = True
