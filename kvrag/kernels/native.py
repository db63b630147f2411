"""kvrag's own compiled operator: a float32 linear layer for a few rows (`rows.c`), with oneDNN's
per-element arithmetic, so a decoding step need not be padded to `ROW_BLOCK` rows to keep the bits
it has among many rows.

It is compiled from `rows.c` with the system's C compiler the first time a process needs it
(`python -m kvrag.kernels.native` does it ahead of time; `make setup` runs that), into `native/`
under `$KVRAG_HOME` (`kvrag.paths`), keyed by the SHA-256 of the source and the compiler's flags. It needs an
x86-64 CPU with AVX-512 and a C compiler (`$CC`, default `cc`) with OpenMP. Where either is
missing, or a layer's shape fails the check against oneDNN (`kvrag.kernels.linear`), the layer
pads its rows instead: the same bits, at the cost of the padded rows (`available()` says which, and
why).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from kvrag.paths import kvrag_home

__all__ = ["available", "build", "pack", "rows_f32", "PANEL"]

log = logging.getLogger("kvrag.kernels")

PANEL = 16
#: panels are computed 8 at a time: a packed weight holds a multiple of this many columns
_COLUMNS = PANEL * 8
_SOURCE = Path(__file__).with_name("rows.c")
_FLAGS = ["-O2", "-mavx512f", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def _directory() -> Path:
    return kvrag_home() / "native"


def _cpu_has_avx512() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace").split()
    except OSError:
        return False
    return "avx512f" in flags and "fma" in flags


def build() -> Path:
    """Compile `rows.c` (once per source, compiler flags and machine kind) and return the library's
    path; raises `OSError` saying what failed."""
    compiler = os.environ.get("CC", "cc")
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join([compiler, *_FLAGS]).encode()).hexdigest()[:16]
    target = _directory() / f"rows-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        try:
            done = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built)], capture_output=True, text=True,
                                  timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise OSError(f"could not run the C compiler {compiler!r} ({e}); set CC to one") from e
        if done.returncode != 0:
            raise OSError(f"{compiler} could not compile {_SOURCE.name}: {done.stderr.strip()[-800:]}")
        os.replace(built, target)  # whole or not at all, whichever process finishes first
    return target


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str]:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512",) and not _cpu_has_avx512():
        return None, "the CPU has no AVX-512"
    try:
        library = ctypes.CDLL(str(build()))
    except OSError as e:
        log.warning("kvrag's native linear kernel is not available (%s): decoding steps pad their rows "
                    "instead (same bits, slower)", e)
        return None, str(e)
    function = library.kvrag_rows_f32
    function.restype = None
    function.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                         ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    return library, ""


def available() -> tuple[bool, str]:
    """Whether the native kernel can run in this process, and if not, why."""
    library, why = _library()
    return library is not None, why


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [out, in] as the kernel reads it: panels of `PANEL` columns, [panels, in, PANEL]."""
    if weight.dtype != torch.float32:
        raise TypeError(f"kvrag's native linear kernel is float32 only, not {weight.dtype}")
    out_features, in_features = weight.shape
    columns = -(-out_features // _COLUMNS) * _COLUMNS
    padded = torch.nn.functional.pad(weight.detach(), (0, 0, 0, columns - out_features))
    return padded.reshape(columns // PANEL, PANEL, in_features).transpose(1, 2).contiguous()


def rows_f32(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
             block: int) -> torch.Tensor:
    """`x` [rows, in] (float32, contiguous) times the packed weight, plus `bias`: [rows, out]."""
    library, why = _library()
    if library is None:
        raise RuntimeError(f"kvrag's native linear kernel is not available: {why}")
    if x.dtype != torch.float32 or packed.dtype != torch.float32 or not x.is_contiguous() or (
            bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.numel() != out_features)):
        raise TypeError("kvrag's native linear kernel takes contiguous float32 rows, weight and bias")
    rows, in_features = x.shape
    if packed.dim() != 3 or packed.shape[1] != in_features or packed.shape[2] != PANEL or packed.shape[0] % 8 \
            or packed.shape[0] * PANEL < out_features:
        raise ValueError(f"a packed weight {tuple(packed.shape)} does not fit rows of {in_features} and {out_features} outputs")
    y = x.new_empty((rows, out_features))
    bias_ptr = bias.data_ptr() if bias is not None else None
    library.kvrag_rows_f32(x.data_ptr(), rows, in_features, packed.data_ptr(), packed.shape[0], bias_ptr, y.data_ptr(),
                           out_features, block, torch.get_num_threads())
    return y


if __name__ == "__main__":  # `python -m kvrag.kernels.native`: build it now (make setup does)
    ok, why = available()
    print(f"kvrag's native linear kernel: {build()}" if ok else f"kvrag's native linear kernel is not available: {why}")
    raise SystemExit(0 if ok else 1)
