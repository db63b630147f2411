"""Model and hardware fingerprints: what must match for a stored state to graft as exact.

A state's bytes are a function of the weights, the tokenizer and template that made its tokens,
the numeric settings (dtype, attention kernel, rope) and the kernels that ran. Each fingerprint is
a pydantic record of those facts plus a `digest` over its canonical JSON; two fingerprints are
compatible only when their digests are equal (fail closed: any unknown difference is a mismatch).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, computed_field, model_validator

from kvrag.errors import ModelError
from kvrag.kernels.attention import INVARIANT
from kvrag.kernels.linear import linear_kernel
from kvrag.paths import kvrag_home

__all__ = ["folder_weights_sha256", "Fingerprinted", "ModelFingerprint", "HardwareFingerprint", "model_fingerprint", "hardware_fingerprint",
           "kernel_name"]

# Config fields that name where a model came from rather than what it computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "architectures"}


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class _Fingerprint(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_stored_digest(cls, data: Any) -> Any:
        # The digest is always recomputed from the fields; a stored one is never trusted.
        if isinstance(data, dict) and "digest" in data:
            data = {k: v for k, v in data.items() if k != "digest"}
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def digest(self) -> str:
        return _sha256_json(self.model_dump(exclude={"digest"}))

    def matches(self, other: "_Fingerprint") -> bool:
        return self.digest == other.digest


class ModelFingerprint(_Fingerprint):
    """What a model computes: weights, config, tokenizer, chat template and numeric settings."""

    name: str
    weights_sha256: str
    config_sha256: str
    tokenizer_sha256: str
    chat_template_sha256: str
    dtype: str
    attn_implementation: str
    rope: dict[str, Any] | None
    transformers_version: str


class HardwareFingerprint(_Fingerprint):
    """Where the numbers were computed: device, kernels and the settings that steer them."""

    device_type: str
    device_name: str
    torch_version: str
    cpu_capability: str
    cuda_version: str | None
    compute_capability: str | None
    blas: list[str]
    #: torch's thread count, where the bits depend on it; None where they do not (the invariant
    #: kernel: tested byte-identical at 1 and 2 threads), so states move between core counts
    num_threads: int | None
    deterministic_algorithms: bool


class Fingerprinted(Protocol):
    """What a model fingerprint is made of (a `kvrag.models.LoadedModel` has it)."""

    name: str
    weights_sha256: str
    tokenizer: Any
    dtype: torch.dtype
    attn: str

    @property
    def config(self) -> Any: ...


def _text_config(model: Fingerprinted) -> Any:
    return model.config.get_text_config(decoder=True)


def _rope_settings(model: Fingerprinted) -> dict[str, Any] | None:
    config = _text_config(model)
    for attr in ("rope_parameters", "rope_scaling"):
        value = getattr(config, attr, None)
        if value:
            return json.loads(json.dumps(value, default=str))
    theta = getattr(config, "rope_theta", None)
    return {"rope_theta": theta} if theta is not None else None


def model_fingerprint(model: Fingerprinted) -> ModelFingerprint:
    import transformers

    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    tokenizer = model.tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    tokenizer_desc = {
        "backend": backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items())),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "added": sorted((str(t), i) for t, i in tokenizer.get_added_vocab().items()),
    }
    return ModelFingerprint(
        name=model.name,
        weights_sha256=model.weights_sha256,
        config_sha256=_sha256_json(json.loads(json.dumps(config, default=str))),
        tokenizer_sha256=_sha256_json(tokenizer_desc),
        chat_template_sha256=hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest(),
        dtype=str(model.dtype).removeprefix("torch."),
        attn_implementation=kernel_name(model.attn, model.dtype),
        rope=_rope_settings(model),
        transformers_version=transformers.__version__,
    )


def kernel_name(attn: str, dtype: torch.dtype) -> str:
    """The invariant kernel's current arithmetic (torch's flash attention on whole 512-key blocks,
    linear layers by oneDNN fed >= 16 rows): states of the earlier ones carry other bits, never found."""
    if attn != INVARIANT:
        return attn
    kernel = linear_kernel(dtype)
    return {"onednn": "invariant/3", "stock": "invariant/2"}.get(kernel, f"invariant/3-{kernel}")


@lru_cache(maxsize=None)
def _blas_lines() -> tuple[str, ...]:
    wanted = re.compile(r"Math Kernel Library|MKL-DNN|oneDNN|OpenBLAS|BLAS_INFO|LAPACK_INFO|OpenMP")
    lines: list[str] = []
    for line in torch.__config__.show().splitlines():
        line = line.strip(" -")
        if line.startswith("Build settings"):
            lines += [item.strip() for item in line.split(",") if wanted.search(item)]
        elif wanted.search(line):
            lines.append(re.sub(r"\s*\(Git Hash [0-9a-f]+\)", "", line))
    return tuple(lines)


@lru_cache(maxsize=None)
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_fingerprint(device: torch.device | str = "cpu", *, threads_matter: bool = True) -> HardwareFingerprint:
    """The fingerprint of the device a model runs on, read now (thread count and flags can change).
    `threads_matter=False` leaves the thread count out: for kernels whose bits do not depend on it."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda:
        major, minor = torch.cuda.get_device_capability(device)
        name, capability = torch.cuda.get_device_name(device), f"{major}.{minor}"
        blas = [f"cudnn {torch.backends.cudnn.version()}", f"tf32 matmul {torch.backends.cuda.matmul.allow_tf32}"]
    else:
        name, capability, blas = _cpu_name(), None, list(_blas_lines())
    return HardwareFingerprint(
        device_type=device.type,
        device_name=name,
        torch_version=torch.__version__,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cuda_version=torch.version.cuda if cuda else None,
        compute_capability=capability,
        blas=blas,
        num_threads=torch.get_num_threads() if threads_matter else None,
        deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
    )


def folder_weights_sha256(folder: Path) -> str:
    """SHA-256 over a model folder's weight files, cached by (path, size, mtime) so loads stay fast."""
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise ModelError(f"no weight files (*.safetensors or *.bin) in {folder}")
    cache_path = kvrag_home() / "weight-digests.json"
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    digest = hashlib.sha256()
    changed = False
    for path in files:
        stat = path.stat()
        cache_key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        if cache_key not in cache:
            file_digest = hashlib.sha256()
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    file_digest.update(block)
            cache[cache_key] = file_digest.hexdigest()
            changed = True
        digest.update(path.name.encode())
        digest.update(bytes.fromhex(cache[cache_key]))
    if changed:
        _atomic_write_text(cache_path, json.dumps(cache, indent=1, sort_keys=True))
    return digest.hexdigest()


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
