"""Linear layers whose every row has the same bits however many rows share the call.

A CPU matrix product picks its kernel from the shape: a float32 `F.linear` (MKL's sgemm) gave a
row other bits among fewer than ~12 rows than among more. Under the invariant kernel every linear
layer (`nn.Linear`, GPT-2's `Conv1D`, the output layer) is computed by oneDNN's matrix product
over a weight it reordered once (`torch.ops.mkldnn`, as torch's own CPU compiler does): a row
has the same bits read alone or among many rows, at any thread count, for every width kvrag's
models use, float32 and bfloat16 (on a CPU with AMX, bfloat16 under `ISA_CAP`; `tests/unit/test_invariant.py` tries them; its speed against
`F.linear` is `benchmarks/linear_kernels.py`'s). A call with fewer than `ROW_BLOCK` rows is still
padded with zero rows, dropped from its output, because a single row can round otherwise.

The reordered weight is a second copy of each layer's weight (made at load), made again whenever
the weight changes through torch (its address, version counter or dtype: an in-place update,
`load_state_dict`, `.to(dtype)`; a write through `.data`, or into a weight made under
`torch.inference_mode`, which keeps no version counter, is not seen). Off the CPU, where torch
has no oneDNN, or where oneDNN has no product for the dtype on this CPU (bfloat16 without AVX512),
a layer runs its own forward fed at least `ROW_BLOCK` rows (another arithmetic, named otherwise in
the fingerprint: see `linear_kernel`).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

__all__ = ["ROW_BLOCK", "make_linear_invariant", "linear_kernel", "ISA_CAP"]

#: oneDNN's AMX products (bfloat16, on CPUs with AMX) choose their blocking by the row count, so a
#: row's bits change with it; below AMX its bfloat16 products keep them. oneDNN reads this cap at
#: its first product, so it is set at import (a cap the user set stays theirs: see `linear_kernel`).
ISA_CAP = "AVX512_CORE_BF16"
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ISA_CAP)

#: a linear layer's call reads at least this many rows
ROW_BLOCK = 16
_DTYPES = (torch.float32, torch.bfloat16)


@lru_cache(maxsize=None)
def linear_kernel(dtype: torch.dtype = torch.float32) -> str:
    """The linear arithmetic this process uses for `dtype` under the invariant kernel: `onednn`, or
    `stock` where torch has no oneDNN or oneDNN has no product for the dtype on this CPU (bfloat16
    needs AVX512 or AVX-NE-CONVERT: on an AVX2-only CPU a bfloat16 model runs the stock product).
    For bfloat16 on a CPU with AMX: `onednn-capped` under `ISA_CAP`, or `onednn-amx` where the
    user's `ONEDNN_MAX_CPU_ISA` lets oneDNN use AMX (then rows are not invariant: not exact)."""
    if not torch.backends.mkldnn.is_available() or dtype not in _DTYPES:
        return "stock"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "stock"
    if dtype == torch.bfloat16 and _cpu_has_amx():
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
        return "onednn-amx" if "AMX" in cap or cap in ("ALL", "DEFAULT", "") else "onednn-capped"
    return "onednn"


@lru_cache(maxsize=None)
def _cpu_has_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text(errors="replace").split()
    except OSError:
        return False


def make_linear_invariant(model: Any) -> Any:
    """Make every linear layer of a transformers causal LM (`nn.Linear` and GPT-2's `Conv1D`)
    row-invariant, in place; idempotent. kvrag does this for `load_model(..., attn="invariant")`;
    call it on a model you loaded yourself with `attn_implementation="invariant"` to get kvrag's bits."""
    if getattr(model, "_kvrag_invariant_linear", False):
        return model
    from transformers.pytorch_utils import Conv1D

    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, Conv1D)):
            stock = module.forward
            onednn = linear_kernel(module.weight.dtype).startswith("onednn")
            forward = _OneDnn(module, transposed=isinstance(module, Conv1D), stock=stock) if onednn else stock
            if onednn:
                forward.prepare()  # now, not in the first answer's time to first token
            module.forward = _AtLeastRows(forward)
    model._kvrag_invariant_linear = True
    return model


class _OneDnn:
    """A linear layer computed by oneDNN over its weight reordered once ([out, in] rows)."""

    def __init__(self, module: torch.nn.Module, *, transposed: bool, stock: Any) -> None:
        self.module, self.transposed, self.stock = module, transposed, stock
        self._made_from: tuple[Any, ...] | None = None
        self._packed: torch.Tensor | None = None

    def _reordered(self, weight: torch.Tensor) -> torch.Tensor:
        # an inference tensor (made under `torch.inference_mode`) keeps no version counter
        version = None if weight.is_inference() else weight._version
        made_from = (weight.data_ptr(), version, weight.dtype, tuple(weight.shape))
        if self._packed is None or made_from != self._made_from:
            rows = weight.detach().t() if self.transposed else weight.detach()
            self._packed = torch.ops.mkldnn._reorder_linear_weight(rows.contiguous(), None)
            self._made_from = made_from
        return self._packed

    def __getstate__(self) -> dict[str, Any]:
        # a reordered (opaque) tensor cannot be copied or pickled: a copy reorders its own weight
        return {**self.__dict__, "_packed": None, "_made_from": None}

    def prepare(self) -> None:
        weight = self.module.weight
        if weight.device.type == "cpu" and linear_kernel(weight.dtype).startswith("onednn") and not weight.is_meta:
            self._reordered(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.module.weight, self.module.bias
        if x.device.type != "cpu" or weight.dtype != x.dtype or not linear_kernel(x.dtype).startswith("onednn"):
            return self.stock(x)
        packed = self._reordered(weight)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, None if bias is None else bias.detach(), "none", [], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])


class _AtLeastRows:
    """A linear layer's forward, fed at least ROW_BLOCK rows."""

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
