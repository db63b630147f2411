"""Linear layers whose every row has the same bits however many rows share the call.

A CPU matrix product picks its kernel from the shape: a float32 `F.linear` (MKL's sgemm) gave a
row other bits among fewer than ~12 rows than among more. Under the invariant kernel every linear
layer (`nn.Linear`, GPT-2's `Conv1D`, the output layer) is computed by oneDNN's matrix product
over a weight it reordered once (`torch.ops.mkldnn`, as torch's own CPU compiler does): a row
has the same bits read alone or among many rows, at any thread count, for every width kvrag's
models use, float32 and bfloat16 (on a CPU with AMX, bfloat16 under `ISA_CAP`; without AVX512-BF16,
bfloat16 layers in float32: see `linear_kernel`; `tests/unit/test_invariant.py` tries them; its speed against
`F.linear` is `benchmarks/linear_kernels.py`'s). oneDNN takes another path for very
few rows (one float32 row of a wide layer; one bfloat16 row at some thread counts), so a call of
fewer than `ROW_BLOCK` rows is fed at least the fewest rows that give each row its bits among
`ROW_BLOCK` (`fewest_rows`: checked per layer shape and thread count, at load; padded with zero
rows, dropped from its output), and one float32 row (a decoding step) is computed by kvrag's own
operator (`kvrag.kernels.native`), which repeats oneDNN's per-element arithmetic (`native_block`:
checked per layer shape at load, against oneDNN's own rows).

The reordered weight is a second copy of each layer's weight (made at load), made again whenever
the weight or bias changes through torch (its address, version counter or dtype: an in-place update,
`load_state_dict`, `.to(dtype)`; a write through `.data`, or into a weight made under
`torch.inference_mode`, which keeps no version counter, is not seen). Off the CPU, where torch
has no oneDNN, or for float16 (for which kvrag uses no oneDNN product),
a layer runs its own forward fed at least `ROW_BLOCK` rows (another arithmetic, named otherwise in
the fingerprint: see `linear_kernel`).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = ["ROW_BLOCK", "NATIVE_ROWS", "make_linear_invariant", "linear_kernel", "rows_invariant", "fewest_rows",
           "native_block", "ISA_CAP"]

#: oneDNN's AMX products (bfloat16, on CPUs with AMX) choose their blocking by the row count, so a
#: row's bits change with it; below AMX its bfloat16 products keep them. oneDNN reads this cap at
#: its first product, so it is set at import (a cap the user set stays theirs: see `linear_kernel`).
ISA_CAP = "AVX512_CORE_BF16"
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ISA_CAP)

#: a linear layer's call reads at least this many rows
ROW_BLOCK = 16
#: float32 calls of at most this many rows (a decoding step) run kvrag's own operator where it
#: checked out; oneDNN is faster for more
NATIVE_ROWS = 1
#: the input blocks oneDNN's float32 product sums in turn, by input width: tried in this order
_BLOCKS = (512, 1024, 256, 2048)
_DTYPES = (torch.float32, torch.bfloat16)


@lru_cache(maxsize=None)
def linear_kernel(dtype: torch.dtype = torch.float32) -> str:
    """The linear arithmetic this process uses for `dtype` under the invariant kernel: `onednn`, or
    `stock` where torch has no oneDNN (or for float16). For bfloat16 on a CPU with AMX:
    `onednn-capped` under `ISA_CAP`, or `onednn-amx` where the user's `ONEDNN_MAX_CPU_ISA` lets
    oneDNN use AMX (then rows are not invariant: not exact). For bfloat16 on a CPU without
    AVX512-BF16 (an AVX2-only CPU included), where oneDNN emulates bfloat16 or has no product for
    it and the emulated product gives a row other bits at other row counts: `onednn-f32` computes
    those layers by oneDNN's float32 product over the same values (exact in float32) and rounds
    each output to bfloat16."""
    if not torch.backends.mkldnn.is_available() or dtype not in _DTYPES:
        return "stock"
    if dtype == torch.bfloat16 and _cpu_has_amx():
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
        return "onednn-amx" if "AMX" in cap or cap in ("ALL", "DEFAULT", "") else "onednn-capped"
    if dtype == torch.bfloat16 and not (_cpu_has("avx512_bf16") and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "onednn-f32"
    return "onednn"


def rows_invariant(dtype: torch.dtype = torch.float32) -> bool:
    """Whether, under the invariant kernel, a linear layer's row in `dtype` has the same bits at any
    row count, so rows of several generations may share a call: oneDNN's products, except its AMX
    bfloat16 product (`onednn-amx`); torch's stock product keeps them only fed `ROW_BLOCK` rows."""
    return linear_kernel(dtype) in ("onednn", "onednn-f32", "onednn-capped")


def _cpu_has_amx() -> bool:
    return _cpu_has("amx_bf16")


@lru_cache(maxsize=None)
def _cpu_has(flag: str) -> bool:
    """Whether the CPU lists `flag` (Linux); False where it cannot be read."""
    try:
        return flag in Path("/proc/cpuinfo").read_text(errors="replace").split()
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


#: per layer shape (out, in, bias, dtype) and thread count: the fewest rows oneDNN gives the bits
#: those rows have among `ROW_BLOCK` (a shorter call is padded to it)
_FEWEST: dict[tuple[Any, ...], int] = {}
#: per layer shape (out, in, bias, dtype): the input block with which kvrag's operator gives one
#: row oneDNN's bits (None: the operator is not used for it)
_BLOCKS_FOUND: dict[tuple[Any, ...], int | None] = {}


def _probe_input(in_features: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(in_features)
    return torch.randn(ROW_BLOCK, in_features, generator=generator).to(dtype)


def fewest_rows(packed: torch.Tensor, out_features: int, in_features: int, dtype: torch.dtype,
                bias: torch.Tensor | None) -> int:
    """The fewest rows (at most `ROW_BLOCK`) from which every call of oneDNN's product over this
    layer's shape gives each row the bits it has among `ROW_BLOCK` rows, at this thread count;
    checked once per shape and thread count with the first such layer's own weight (`packed`)."""
    key = (out_features, in_features, bias is not None, dtype, torch.get_num_threads())
    if key not in _FEWEST:
        x = _probe_input(in_features, dtype)
        reference = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        fewest = ROW_BLOCK
        while fewest > 1 and torch.equal(torch.ops.mkldnn._linear_pointwise(x[: fewest - 1], packed, bias, "none", [], ""),
                                         reference[: fewest - 1]):
            fewest -= 1
        _FEWEST[key] = fewest
    return _FEWEST[key]


def native_block(packed: torch.Tensor, rows_weight: torch.Tensor, bias: torch.Tensor | None) -> int | None:
    """The input block with which kvrag's operator (`kvrag.kernels.native`) gives one float32 row
    the bits oneDNN gives it among `ROW_BLOCK` rows, for this layer's shape (checked once per shape,
    each of 16 rows alone, with the first such layer's own weight); None where no block does or the
    operator is not available here. Its bits depend on no thread count: each is one chain of sums."""
    key = (*rows_weight.shape, bias is not None, rows_weight.dtype)
    if key not in _BLOCKS_FOUND:
        _BLOCKS_FOUND[key] = _find_block(packed, rows_weight, bias)
    return _BLOCKS_FOUND[key]


def _find_block(packed: torch.Tensor, rows_weight: torch.Tensor, bias: torch.Tensor | None) -> int | None:
    from kvrag.kernels import native

    if rows_weight.dtype != torch.float32 or not native.available()[0]:
        return None
    out_features, in_features = rows_weight.shape
    x = _probe_input(in_features, rows_weight.dtype)
    reference = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    kernel_weight = native.pack(rows_weight)
    for block in (in_features, *_BLOCKS) if in_features <= _BLOCKS[0] else _BLOCKS:
        if all(torch.equal(native.rows_f32(x[i : i + 1].contiguous(), kernel_weight, bias, out_features, block),
                           reference[i : i + 1]) for i in range(ROW_BLOCK)):
            return block
    return None


class _Reordered(NamedTuple):
    """What a layer computes with, made from its weight and bias at one moment (replaced whole, so a
    thread never reads half of an old one and half of a new one)."""

    made_from: tuple[Any, ...]
    #: the weight reordered for oneDNN ([out, in] rows)
    packed: torch.Tensor
    #: the dtype oneDNN computes in: float32 for a bfloat16 layer under `onednn-f32`
    compute: torch.dtype
    #: the bias in `compute`'s dtype
    bias: torch.Tensor | None
    #: kvrag's operator's weight and input block (None: not for this layer)
    native: tuple[torch.Tensor, int] | None


class _OneDnn:
    """A linear layer computed by oneDNN over its weight reordered once ([out, in] rows); a float32
    call of a few rows by kvrag's own operator, where it gives oneDNN's bits (`few`)."""

    def __init__(self, module: torch.nn.Module, *, transposed: bool, stock: Any) -> None:
        self.module, self.transposed, self.stock = module, transposed, stock
        self._made: _Reordered | None = None

    def _reordered(self, weight: torch.Tensor) -> _Reordered:
        made_from = (*_identity(weight), *_identity(self.module.bias))
        made = self._made
        if made is None or made.made_from != made_from:
            made = self._made = self._reorder(weight, made_from)
        return made

    def _reorder(self, weight: torch.Tensor, made_from: tuple[Any, ...]) -> _Reordered:
        compute = torch.float32 if linear_kernel(weight.dtype) == "onednn-f32" else weight.dtype
        rows = (weight.detach().t() if self.transposed else weight.detach()).to(compute).contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(rows, None)
        module_bias = self.module.bias
        bias = None if module_bias is None else module_bias.detach().to(compute).contiguous()
        fewest_rows(packed, *rows.shape, rows.dtype, bias)  # now, at load, not in an answer's time
        block = native_block(packed, rows, bias)
        native = None
        if block is not None:
            from kvrag.kernels.native import pack

            native = (pack(rows), block)
        return _Reordered(made_from, packed, compute, bias, native)

    def __getstate__(self) -> dict[str, Any]:
        # a reordered (opaque) tensor cannot be copied or pickled: a copy reorders its own weight
        return {**self.__dict__, "_made": None}

    def few(self, flat: torch.Tensor) -> torch.Tensor | None:
        """`flat` ([rows, in], fewer than `ROW_BLOCK` rows) with the bits its rows have among many:
        one float32 row by kvrag's operator where it checked out, else oneDNN's product fed at least
        its `fewest_rows`; None where oneDNN does not run this layer (the caller pads)."""
        weight = self.module.weight
        if flat.device.type != "cpu" or weight.dtype != flat.dtype or not linear_kernel(flat.dtype).startswith("onednn"):
            return None
        made = self._reordered(weight)
        given, flat = flat.dtype, flat.to(made.compute)
        rows, out_features = flat.shape[0], _out_features(weight, self.transposed)
        if rows <= NATIVE_ROWS and made.native is not None and flat.dtype == torch.float32:
            from kvrag.kernels.native import rows_f32

            kernel_weight, block = made.native
            return rows_f32(flat.contiguous(), kernel_weight, made.bias, out_features, block).to(given)
        fewest = fewest_rows(made.packed, out_features, flat.shape[1], flat.dtype, made.bias)
        fed = flat if rows >= fewest else torch.nn.functional.pad(flat, (0, 0, 0, fewest - rows))
        return torch.ops.mkldnn._linear_pointwise(fed, made.packed, made.bias, "none", [], "")[:rows].to(given)

    def prepare(self) -> None:
        weight = self.module.weight
        if weight.device.type == "cpu" and linear_kernel(weight.dtype).startswith("onednn") and not weight.is_meta:
            self._reordered(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.module.weight
        if x.device.type != "cpu" or weight.dtype != x.dtype or not linear_kernel(x.dtype).startswith("onednn"):
            return self.stock(x)
        made = self._reordered(weight)
        flat = x.reshape(-1, x.shape[-1]).to(made.compute)
        out = torch.ops.mkldnn._linear_pointwise(flat, made.packed, made.bias, "none", [], "").to(x.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class _AtLeastRows:
    """A linear layer's forward, a call of fewer than ROW_BLOCK rows computed as among them."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows >= ROW_BLOCK or rows == 0:
            return self.forward(x)
        flat = x.reshape(rows, x.shape[-1])
        few = getattr(self.forward, "few", None)
        out = few(flat) if few is not None else None
        if out is None:
            out = self.forward(torch.nn.functional.pad(flat, (0, 0, 0, ROW_BLOCK - rows)))[:rows]
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _identity(tensor: torch.Tensor | None) -> tuple[Any, ...]:
    """What tells a parameter's values changed through torch: its address, version counter (an
    inference tensor, made under `torch.inference_mode`, keeps none), dtype and shape."""
    if tensor is None:
        return (None,)
    return tensor.data_ptr(), None if tensor.is_inference() else tensor._version, tensor.dtype, tuple(tensor.shape)


def _out_features(weight: torch.Tensor, transposed: bool) -> int:
    """A layer's output width (GPT-2's `Conv1D` keeps its weight [in, out])."""
    return weight.shape[1] if transposed else weight.shape[0]
