"""A schedule-invariant attention kernel, `attn="invariant"`: each query row's result has the same
bits however the prompt was split into forward calls.

With sdpa or eager, a graft equals a fresh computation only *in the same segments*: the reduction
over keys is blocked according to how many keys a call holds, so one pass over a whole prompt and
the same prompt read in two parts differ in the last bits. Here every reduction has a fixed shape:

- keys are taken in blocks of `KEY_BLOCK` aligned at absolute position 0 (a sliding-window layer,
  which holds a later tail, is padded at the front to the block boundary), in increasing order,
  with an online softmax; a position a row may not see scores the float32 minimum, so its weight
  is an exact zero, and blocks a row cannot see at all are exact no-ops;
- query rows are taken from a `QUERY_BLOCK`-aligned absolute position, so each matrix product has
  a multiple of `QUERY_BLOCK` rows;
- scores, softmax and the weighted sum are computed in float32 whatever the model's dtype.

The linear layers around attention depend on the row count too: a CPU matrix product picks its
blocking from the shape (float32 rows differed among fewer than ~12 rows, and smollm2-135m's
1,536-wide down projection again at 64 rows and more). Under this kernel every linear layer
computes its rows in 16-row blocks aligned at absolute positions (`kvrag.kernels.linear`), so a
row's bits depend on its values and position only. `ModelRunner` also pads prompt reads shorter
than `MIN_FORWARD_ROWS` with dummy tokens after them and drops their cache entries (kept from
before the linear layers were blocked; harmless). Decoding steps are one row, as in a stock
`model.generate`.

The kernel is registered with transformers under the name `invariant` (an attention function and
its mask), so a stock `AutoModelForCausalLM.from_pretrained(..., attn_implementation="invariant")`
after `import kvrag`, its linear layers made invariant with
`kvrag.kernels.linear.make_linear_invariant(model)`, computes the same bits as kvrag does.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["INVARIANT", "KEY_BLOCK", "QUERY_BLOCK", "MIN_FORWARD_ROWS", "invariant_attention", "register"]

INVARIANT = "invariant"
#: keys reduced together, aligned at absolute position 0
KEY_BLOCK = 64
#: query rows are aligned to this absolute boundary (it divides KEY_BLOCK)
QUERY_BLOCK = 16
#: prompt reads shorter than this are padded (see `ModelRunner.forward`)
MIN_FORWARD_ROWS = 16

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
    kv_len = key.shape[-2]
    scale = float(scaling) if scaling is not None else head_dim**-0.5
    last = _absolute_last(kwargs, kv_len)
    k_start = max(0, last - kv_len + 1)
    q_start = max(0, last - q_len + 1)

    # Pad keys at the front to a KEY_BLOCK boundary and at the back to a whole block; pad queries
    # at the front to a QUERY_BLOCK boundary and at the back to a whole block.
    k_front, q_front = k_start % KEY_BLOCK, q_start % QUERY_BLOCK
    k_total = -(-(k_front + kv_len) // KEY_BLOCK) * KEY_BLOCK
    q_total = -(-(q_front + q_len) // QUERY_BLOCK) * QUERY_BLOCK
    groups = heads // key.shape[1]
    k = _pad_rows(_repeat_heads(key, groups).float(), k_front, k_total)
    v = _pad_rows(_repeat_heads(value, groups).float(), k_front, k_total)
    q = _pad_rows(query.float() * scale, q_front, q_total)  # scaled once, row by row
    visible = _visibility(attention_mask, batch, q_len, kv_len, q_start, k_start, query.device)
    visible = torch.nn.functional.pad(visible, (k_front, k_total - k_front - kv_len, q_front, q_total - q_front - q_len))

    m = torch.full((batch, heads, q_total, 1), float("-inf"), dtype=torch.float32, device=query.device)
    denom = torch.zeros((batch, heads, q_total, 1), dtype=torch.float32, device=query.device)
    acc = torch.zeros((batch, heads, q_total, head_dim), dtype=torch.float32, device=query.device)
    q_base = q_start - q_front  # absolute position of padded query row 0 (a QUERY_BLOCK multiple)
    k_base = k_start - k_front  # absolute position of padded key 0 (a KEY_BLOCK multiple)
    for block in range(k_total // KEY_BLOCK):
        k_abs = k_base + block * KEY_BLOCK
        # Rows whose query block starts before this key block cannot see any of it: skip them.
        first_row = max(0, k_abs - q_base)
        if first_row >= q_total:
            break
        cols = slice(block * KEY_BLOCK, (block + 1) * KEY_BLOCK)
        scores = torch.matmul(q[:, :, first_row:], k[:, :, cols].transpose(-1, -2))
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        block_visible = visible[:, :, first_row:, cols]
        if not bool(block_visible.all()):  # most blocks lie wholly before their rows: nothing to mask
            scores = scores.masked_fill(~block_visible, _MASKED)
        m_rows, denom_rows, acc_rows = m[:, :, first_row:], denom[:, :, first_row:], acc[:, :, first_row:]
        m_new = torch.maximum(m_rows, scores.amax(dim=-1, keepdim=True))
        correction = torch.exp(m_rows - m_new)
        weights = scores.sub_(m_new).exp_()
        denom_rows.mul_(correction).add_(weights.sum(dim=-1, keepdim=True))
        acc_rows.mul_(correction).add_(torch.matmul(weights, v[:, :, cols]))
        m_rows.copy_(m_new)
    out = (acc / denom)[:, :, q_front : q_front + q_len]
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def _repeat_heads(states: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return states
    batch, kv_heads, length, dim = states.shape
    return states[:, :, None].expand(batch, kv_heads, groups, length, dim).reshape(batch, kv_heads * groups, length, dim)


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
