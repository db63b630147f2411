"""Linear layers whose every row has the same bits however many rows share the call.

A CPU matrix product picks its kernel from the shape: on this machine a float32 `F.linear` gave a
row other bits among fewer than ~12 rows than among more, and the same bits for every row count
from 12 up (measured for every width kvrag's models use, float32 and bfloat16, 1 and 2 threads,
up to 8,192 rows; `tests/unit/test_invariant.py` tries them). So a question of 5 tokens read after a
graft differed from the same 5 rows inside one pass over the whole prompt.

Here every linear layer of a model under the invariant kernel reads at least `ROW_BLOCK` rows: a
call with fewer is padded with zero rows, which are dropped from its output. A call with
`ROW_BLOCK` rows or more is the layer's own stock forward, untouched, so a row's bits depend on its
values only.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ROW_BLOCK", "make_linear_invariant"]

#: a linear layer's call reads at least this many rows
ROW_BLOCK = 16


def make_linear_invariant(model: Any) -> Any:
    """Make every linear layer of a transformers causal LM (`nn.Linear` and GPT-2's `Conv1D`)
    row-invariant, in place; idempotent. kvrag does this for `load_model(..., attn="invariant")`;
    call it on a model you loaded yourself with `attn_implementation="invariant"` to get kvrag's bits."""
    if getattr(model, "_kvrag_invariant_linear", False):
        return model
    from transformers.pytorch_utils import Conv1D

    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, Conv1D)):
            module.forward = _AtLeastRows(module.forward)
    model._kvrag_invariant_linear = True
    return model


class _AtLeastRows:
    """A linear layer's own forward, fed at least ROW_BLOCK rows."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows >= ROW_BLOCK or rows == 0:
            return self.forward(x)
        flat = x.reshape(rows, x.shape[-1])
        padded = torch.nn.functional.pad(flat, (0, 0, 0, ROW_BLOCK - rows))
        out = self.forward(padded)[:rows]
        return out.reshape(*x.shape[:-1], out.shape[-1])
