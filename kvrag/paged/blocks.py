"""A paged engine's KV blocks as kvrag artifacts: what a block holds and how its bytes are laid out.

A serving engine with paged attention (vLLM) keeps K/V in fixed-size blocks, one tensor per layer
and block. A stored block is one block's tensors from every layer, laid end to end in the order
its signed manifest lists them, for the tokens of the block after the tokens of every block before
it (the chain). Whether the bytes mean anything depends on the engine that wrote them (its
version, model, dtype, block size, layout, attention backend, hardware): `BlockEngine` names all of
it, and a block written under other settings is foreign.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, Mapping, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvrag.artifacts.digests import PayloadChunking
from kvrag.artifacts.format import PayloadSeal, check_payload_cover, tensor_over
from kvrag.errors import IntegrityError

__all__ = ["BLOCK_FORMAT", "BlockEngine", "BlockLayer", "BlockManifest", "parse_block_manifest", "block_payload",
           "block_tensors"]

BLOCK_FORMAT = "kvrag.block/1"
#: bounds on what a manifest may claim, checked before anything is allocated
MAX_BLOCK_TOKENS = 1 << 12
MAX_BLOCK_LAYERS = 1 << 10
MAX_TENSOR_DIMS = 8
_DTYPES = {name: dtype for name, dtype in (("F32", torch.float32), ("BF16", torch.bfloat16), ("F16", torch.float16),
                                           ("F8_E4M3", torch.float8_e4m3fn), ("F8_E5M2", torch.float8_e5m2),
                                           ("U8", torch.uint8))}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


@dataclass(frozen=True)
class BlockEngine:
    """What makes a block's bytes valid, as `name -> value` settings; `digest` names them all."""

    settings: Mapping[str, str]

    @cached_property
    def digest(self) -> str:
        canonical = json.dumps(dict(self.settings), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(b"kvrag-block-engine/1\x00" + canonical.encode()).hexdigest()


class BlockLayer(BaseModel):
    """One layer's tensor of one block: its name, dtype and shape."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    dtype: str = Field(max_length=16)
    shape: list[int] = Field(max_length=MAX_TENSOR_DIMS)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "BlockLayer":
        """The layer entry of `tensor` (one block's K/V of one layer)."""
        return cls(name=name, dtype=_DTYPE_NAMES[tensor.dtype], shape=list(tensor.shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def bytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.torch_dtype.itemsize


class BlockManifest(BaseModel):
    """A stored block, signed: its chain, tokens, engine and layout, and its payload's checks."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["kvrag.block/1"] = BLOCK_FORMAT
    key: str = Field(pattern=r"^[0-9a-f]{64}$")
    parent_key: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    start: int = Field(ge=0, le=1 << 24)
    token_ids: list[int] = Field(min_length=1, max_length=MAX_BLOCK_TOKENS)
    engine: str = Field(pattern=r"^[0-9a-f]{64}$")
    engine_settings: dict[str, str] = Field(max_length=64)
    layers: list[BlockLayer] = Field(min_length=1, max_length=MAX_BLOCK_LAYERS)
    payload_bytes: int = Field(ge=0, le=1 << 34)
    payload_chunk_bytes: int = Field(ge=1, le=1 << 30)
    payload_chunks: list[str] = Field(max_length=1 << 16)
    payload_seal: PayloadSeal
    signature: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @property
    def chunking(self) -> PayloadChunking:
        return PayloadChunking(self.payload_bytes, self.payload_chunk_bytes, tuple(self.payload_chunks))

    @property
    def plain_bytes(self) -> int:
        plain = self.payload_seal.plain_bytes
        return self.payload_bytes if plain is None else plain

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json().encode()


def parse_block_manifest(raw: bytes) -> BlockManifest:
    """Parse and bound stored manifest bytes (already authenticated); anything malformed or
    inconsistent is an `IntegrityError`."""
    try:
        manifest = BlockManifest.model_validate_json(raw)
    except (ValidationError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise IntegrityError(f"block manifest is malformed: {str(e).splitlines()[0]}") from e
    if any(layer.dtype not in _DTYPES or any(not 0 < n <= 1 << 20 for n in layer.shape) for layer in manifest.layers):
        raise IntegrityError("block manifest is malformed: a layer names an unknown dtype or an impossible shape")
    check_payload_cover("block manifest", manifest.payload_bytes, manifest.payload_chunk_bytes,
                        manifest.payload_chunks, manifest.payload_seal)
    if sum(layer.bytes for layer in manifest.layers) != manifest.plain_bytes:
        raise IntegrityError("block manifest is malformed: its layers do not add up to its payload")
    return manifest


def block_payload(tensors: Sequence[torch.Tensor]) -> tuple[bytearray, list[BlockLayer]]:
    """One block's tensors (one per layer, in order) as one buffer, and the layers that lay it out."""
    layers = [BlockLayer.of(str(index), tensor) for index, tensor in enumerate(tensors)]
    payload = bytearray(sum(layer.bytes for layer in layers))
    if payload:  # each layer copied once, straight into the payload
        flat, at = torch.frombuffer(payload, dtype=torch.uint8), 0
        for layer, tensor in zip(layers, tensors):
            flat[at : at + layer.bytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
            at += layer.bytes
    return payload, layers


def block_tensors(plain: Any, manifest: BlockManifest) -> list[torch.Tensor]:
    """The layers' tensors over checked plaintext `plain`, as its signed manifest lays them out."""
    tensors, at = [], 0
    for layer in manifest.layers:
        tensors.append(tensor_over(plain, layer.torch_dtype, tuple(layer.shape), at, at + layer.bytes))
        at += layer.bytes
    return tensors
