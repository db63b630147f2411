"""Linear layers whose every row has the same bits however many rows share the call.

A CPU matrix product picks its blocking from the shape: on this machine a float32 `F.linear`
gave a row different bits among fewer than ~12 rows than among more, and smollm2-135m's 1,536-wide
down projection changed again at 64 rows and more. So one pass over a whole prompt and the same
prompt read in two calls differed in the last bits, before attention was even reached.

Here every linear layer of a model under the invariant kernel computes its rows in fixed blocks of
`ROW_BLOCK` rows aligned at absolute positions (position p is row p % 16 of block p // 16; rows of
a block this call does not have are zeros), as one batched product of identical `[16, K] x [K, N]`
problems. A row's bits then depend only on its own values and its position, whatever else the call
holds. The forward's absolute positions come from a pre-hook on the model (its `position_ids`, or
the cache's length); the output layer, which sees only the rows whose logits are kept, gets those
rows' positions from `logits_to_keep`.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

__all__ = ["ROW_BLOCK", "make_linear_invariant"]

ROW_BLOCK = 16

# (positions of the forward's rows, positions of the rows whose logits are kept)
_POSITIONS: contextvars.ContextVar[tuple[torch.Tensor, torch.Tensor] | None] = contextvars.ContextVar(
    "kvrag_invariant_positions", default=None)


def make_linear_invariant(model: Any) -> Any:
    """Make every linear layer of a transformers causal LM (`nn.Linear` and GPT-2's `Conv1D`)
    row-invariant, in place; idempotent. kvrag does this for `load_model(..., attn="invariant")`;
    call it on a model you loaded yourself with `attn_implementation="invariant"` to get kvrag's bits."""
    if getattr(model, "_kvrag_invariant_linear", False):
        return model
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            if module is not head:  # the output layer's weight is the embedding's (tied): left as it is
                _store_as_kn(module)
            module.forward = _Forward(module, transposed=False, head=module is head)
        elif isinstance(module, Conv1D):
            module.forward = _Forward(module, transposed=True, head=module is head)
    model.register_forward_pre_hook(_capture, with_kwargs=True)
    model._kvrag_invariant_linear = True
    return model


def _store_as_kn(module: torch.nn.Linear) -> None:
    """Keep the [N, K] weight in [K, N] memory order (same values, same shape, no copy kept), so the
    batched product reads a contiguous [K, N] matrix: with the transposed view it was given, a CPU
    `bmm` gave a row other bits in a batch of one block than in a batch of several (measured for
    gemma3-270m's 1,024- and 2,048-wide inputs), so a prompt read in two calls differed from one pass."""
    with torch.no_grad():
        module.weight.data = module.weight.data.t().contiguous().t()


def _capture(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    rows = (ids if ids is not None else embeds).shape[1]
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        positions = position_ids.reshape(-1, position_ids.shape[-1])[0].to(torch.long)
    else:
        cache = kwargs.get("past_key_values")
        start = int(cache.get_seq_length()) if cache is not None else 0
        positions = torch.arange(start, start + rows)
    keep = kwargs.get("logits_to_keep", 0)
    if isinstance(keep, int):
        kept = positions[-keep:] if keep else positions
    else:
        kept = positions[torch.as_tensor(keep, dtype=torch.long)]
    _POSITIONS.set((positions.cpu(), kept.cpu()))


class _Forward:
    """A linear layer's forward in aligned row blocks."""

    def __init__(self, module: Any, *, transposed: bool, head: bool) -> None:
        self.module, self.transposed, self.head = module, transposed, head

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        # [K, N]: the product is x @ weight_kn
        weight_kn = module.weight if self.transposed else module.weight.t()
        known = _POSITIONS.get()
        positions = None
        if known is not None:
            candidate = known[1] if self.head else known[0]
            if x.shape[-2] == candidate.numel():
                positions = candidate
        if positions is None:  # called outside a captured forward: rows at positions 0, 1, ...
            positions = torch.arange(x.shape[-2])
        # a weight not held in [K, N] order (the tied output layer's) takes one block per product
        out = _blocked(x, positions, weight_kn, one_block_at_a_time=not weight_kn.is_contiguous())
        if module.bias is not None:
            out = out + module.bias
        return out


def _blocked(x: torch.Tensor, positions: torch.Tensor, weight_kn: torch.Tensor, *,
             one_block_at_a_time: bool = False) -> torch.Tensor:
    """`x @ weight_kn` with each row computed as row `p % 16` of the 16-row block `p // 16`
    (`one_block_at_a_time`: each block its own product, for a weight that is not [K, N] in memory)."""
    *lead, rows, k = x.shape
    n = weight_kn.shape[1]
    flat = x.reshape(-1, rows, k)
    batch = flat.shape[0]
    first = int(positions[0]) if rows else 0
    contiguous = rows > 0 and int(positions[-1]) - first == rows - 1 and bool(
        (positions == torch.arange(first, first + rows)).all())
    if contiguous:
        front = first % ROW_BLOCK
        total = -(-(front + rows) // ROW_BLOCK) * ROW_BLOCK
        padded = torch.nn.functional.pad(flat, (0, 0, front, total - front - rows))
        blocks = padded.reshape(batch * (total // ROW_BLOCK), ROW_BLOCK, k)
        out = _bmm(blocks, weight_kn, one_block_at_a_time)
        out = out.reshape(batch, total, n)[:, front : front + rows]
    else:
        block_of = torch.div(positions, ROW_BLOCK, rounding_mode="floor")
        used, slot = torch.unique(block_of, sorted=True, return_inverse=True)
        row = positions % ROW_BLOCK
        blocks = flat.new_zeros(batch, used.numel(), ROW_BLOCK, k)
        blocks[:, slot, row] = flat
        merged = blocks.reshape(-1, ROW_BLOCK, k)
        out = _bmm(merged, weight_kn, one_block_at_a_time).reshape(batch, used.numel(), ROW_BLOCK, n)
        out = out[:, slot, row]
    return out.reshape(*lead, rows, n)


def _bmm(blocks: torch.Tensor, weight_kn: torch.Tensor, one_block_at_a_time: bool) -> torch.Tensor:
    k, n = weight_kn.shape
    if one_block_at_a_time and blocks.shape[0] > 1:
        return torch.cat([torch.bmm(block[None], weight_kn[None]) for block in blocks])
    return torch.bmm(blocks, weight_kn.expand(blocks.shape[0], k, n))
