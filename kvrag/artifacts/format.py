"""The state artifact: a safetensors payload of per-layer K/V tensors and a pydantic manifest.

This module is the one place where tensors become bytes and bytes become tensors. Reading never
unpickles and never trusts a size before checking it: the payload's SHA-256 is checked against the
manifest, then its safetensors header is parsed with a size cap and every entry is checked against
the manifest's shapes and dtypes before a tensor view is made over the buffer (zero-copy).
Integrity is checked chunk by chunk (in parallel; see `kvrag.artifacts.digests`): by the
manifest's keyed tags, or the AEAD tags of a confidential state (`payload_seal`, see
`kvrag.artifacts.payloads`), else, for a manifest that names neither, by the chunks' SHA-256 digests. The
whole-payload SHA-256 of the plaintext is recorded as the exactness record, computed once at
deposit; no read waits on it.
"""

from __future__ import annotations

import hashlib
import json
import struct
import warnings
from datetime import datetime, timezone
from typing import Annotated, Any, Literal, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvrag.artifacts.digests import LEGACY_CHUNK_BYTES, CheckedBuffer, PayloadChunking, open_payload
from kvrag.errors import IntegrityError
from kvrag.models.fingerprints import HardwareFingerprint, ModelFingerprint

__all__ = [
    "FORMAT",
    "LayerEntry",
    "DepositReceipt",
    "PayloadSeal",
    "StateManifest",
    "state_key",
    "encode_payload",
    "decode_payload",
    "plaintext_tensors",
    "payload_plan",
    "tensor_over",
    "header_bytes",
    "parse_manifest",
    "check_payload_cover",
    "sha256_hex",
]

FORMAT = "kvrag.state/1"
MAX_HEADER_BYTES = 16 << 20
MAX_LAYERS = 1024
MAX_TOKENS = 1 << 22
#: Token ids fit in 31 bits (every vocabulary does); the model's own vocabulary bounds them further.
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]

_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def sha256_hex(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


def state_key(scope: str, parent_key: str | None, token_ids: list[int]) -> str:
    """Content address of a state: the same tokens after the same chain in the same scope (model
    fingerprint, hardware, namespace and signing key; see `kvrag.trust.identity.key_scope`)."""
    digest = hashlib.sha256()
    digest.update(b"kvrag-state-key\x00")
    digest.update(scope.encode())
    digest.update(b"\x00" + (parent_key or "root").encode() + b"\x00")
    if any(not 0 <= t < 1 << 63 for t in token_ids):
        raise IntegrityError("token ids must be non-negative 64-bit integers")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.hexdigest()


class LayerEntry(BaseModel):
    """One layer's K and V as the model's cache holds them after the state's segment.

    Full-attention layers hold only this segment's tokens (the chain supplies the rest); sliding
    layers hold their whole window, which may reach back into parent segments.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["full", "sliding"]
    window: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    first_position: int = Field(ge=0, le=MAX_TOKENS)
    length: int = Field(ge=0, le=MAX_TOKENS)
    key_shape: tuple[int, int, int, int]
    value_shape: tuple[int, int, int, int]
    dtype: Literal["F32", "F16", "BF16", "F64"]


class DepositReceipt(BaseModel):
    """What verified the state when it was deposited."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    canary_token_ids: list[TokenId] = Field(max_length=4096)
    canary_logits_sha256: str
    fresh_logits_sha256: str
    verified: bool
    compute_ms: float
    created_at: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat())


#: bytes an AES-GCM tag adds to each stored chunk
AEAD_TAG_BYTES = 16


class PayloadSeal(BaseModel):
    """The payload's per-read check, keyed by the signing key (see `kvrag.artifacts.payloads`).

    `blake3-keyed/1`: `tags` holds one keyed BLAKE3 tag per stored chunk, bound to the state's key
    and the chunk's index. `aes-256-gcm/1`: each stored chunk is its plaintext chunk encrypted
    under a key derived for this state from `nonce`, its AEAD tag appended; `plain_bytes` and
    `plain_chunk_bytes` give the plaintext's size and chunk size."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    scheme: Literal["blake3-keyed/1", "aes-256-gcm/1"]
    tags: list[str] = Field(default_factory=list, max_length=1 << 20)
    nonce: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")
    plain_bytes: int | None = Field(default=None, ge=0, le=1 << 40)
    plain_chunk_bytes: int | None = Field(default=None, ge=1, le=1 << 30)


class StateManifest(BaseModel):
    """Everything needed to decide, before touching the payload, whether a state may be grafted."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["kvrag.state/1"] = FORMAT
    key: str = Field(pattern=r"^[0-9a-f]{64}$")
    parent_key: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    model_fingerprint: ModelFingerprint
    hardware_fingerprint: HardwareFingerprint
    token_ids: list[TokenId] = Field(max_length=MAX_TOKENS)
    text_sha256: str
    start: int = Field(ge=0, le=MAX_TOKENS)
    token_count: int = Field(ge=1, le=MAX_TOKENS)
    layers: list[LayerEntry] = Field(max_length=MAX_LAYERS)
    payload_sha256: str
    payload_bytes: int = Field(ge=0, le=1 << 40)
    payload_chunk_bytes: int = Field(default=LEGACY_CHUNK_BYTES, ge=1, le=1 << 30)
    payload_chunks: list[str] = Field(default_factory=list, max_length=1 << 20)
    deposit: DepositReceipt
    #: the prompt layout the segment was cut by (`kvrag.core.prompt`; None: not named)
    prompt_layout: str | None = Field(default=None, max_length=32)
    #: the payload's per-read check (None: each chunk's SHA-256 is checked)
    payload_seal: PayloadSeal | None = None
    signature: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @property
    def end(self) -> int:
        return self.start + self.token_count

    @property
    def chunking(self) -> PayloadChunking:
        """The stored payload's size and chunk SHA-256 digests, checked by those digests (a reader
        with the signing key checks by `payload_seal` instead: `kvrag.artifacts.payloads.chunking_of`)."""
        return PayloadChunking(self.payload_bytes, self.payload_chunk_bytes, tuple(self.payload_chunks))

    @property
    def plain_bytes(self) -> int:
        """The plaintext payload's size (the stored size, unless the payload is encrypted)."""
        seal = self.payload_seal
        return self.payload_bytes if seal is None or seal.plain_bytes is None else seal.plain_bytes

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json().encode()


def parse_manifest(data: bytes | str) -> StateManifest:
    """Parse and validate manifest bytes; anything malformed is an `IntegrityError`."""
    try:
        manifest = StateManifest.model_validate_json(data)
    except (ValidationError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise IntegrityError(f"state manifest is malformed: {str(e).splitlines()[0]}") from e
    if len(manifest.token_ids) != manifest.token_count:
        raise IntegrityError("state manifest is malformed: token_ids and token_count disagree")
    check_payload_cover("state manifest", manifest.payload_bytes, manifest.payload_chunk_bytes,
                        manifest.payload_chunks, manifest.payload_seal)
    return manifest


def check_payload_cover(what: str, payload_bytes: int, chunk_bytes: int, chunks: list[str], seal: PayloadSeal | None) -> None:
    """That a manifest's chunk digests, and its seal's tags or encrypted chunks, cover exactly its
    payload; an `IntegrityError` naming `what` otherwise."""
    count = -(-payload_bytes // chunk_bytes)
    if len(chunks) != count:
        raise IntegrityError(f"{what} is malformed: chunk digests do not cover the payload")
    if seal is not None and seal.scheme == "blake3-keyed/1":
        if len(seal.tags) != count or seal.nonce is not None or seal.plain_bytes is not None:
            raise IntegrityError(f"{what} is malformed: its keyed tags do not cover the payload")
    elif seal is not None:
        plain, plain_chunk = seal.plain_bytes, seal.plain_chunk_bytes
        if (
            seal.tags or seal.nonce is None or plain is None or plain_chunk is None
            or chunk_bytes != plain_chunk + AEAD_TAG_BYTES
            or -(-plain // plain_chunk) != count
            or payload_bytes != plain + AEAD_TAG_BYTES * count
        ):
            raise IntegrityError(f"{what} is malformed: its encrypted chunks do not cover the payload")


def tensor_names(index: int) -> tuple[str, str]:
    return f"layers.{index}.keys", f"layers.{index}.values"


def _layer_order(name: str) -> tuple[int, int, str]:
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in ("keys", "values"):
        return int(parts[1]), parts[2] == "values", ""
    return 1 << 30, 0, name


def encode_payload(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Safetensors bytes of `tensors`, exactly as they are (same dtype, no conversion), laid out
    in layer order (layer 0's keys and values first): a reader can use a layer as soon as the
    chunks up to it are checked, while later layers are still arriving. `safetensors.torch.save`
    orders by name (layer 10 before layer 2), so the file is written here; safetensors reads it."""
    names = sorted(tensors, key=_layer_order)
    prepared = {name: tensors[name].detach().contiguous().cpu() for name in names}
    header: dict[str, Any] = {}
    offset = 0
    for name in names:
        tensor = prepared[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    out = bytearray(8 + len(raw) + offset)
    out[:8] = struct.pack("<Q", len(raw))
    out[8 : 8 + len(raw)] = raw
    view = memoryview(out)
    start = 8 + len(raw)
    for name in names:
        tensor = prepared[name]
        begin, end = header[name]["data_offsets"]
        if end > begin:
            view[start + begin : start + end] = tensor.reshape(-1).view(torch.uint8).numpy().data
    return bytes(out)


def payload_plan(view: memoryview, manifest: StateManifest) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """Each tensor's dtype, shape and byte range in a plaintext payload, from its safetensors header
    (`view` needs to hold only the header), checked against the manifest's layers: no tensor
    missing, extra, of another dtype or shape, overlapping, leaving holes or overrunning the
    payload's size."""
    header, data_start = _read_header(view, manifest.plain_bytes)
    expected = {}
    for index, layer in enumerate(manifest.layers):
        key_name, value_name = tensor_names(index)
        expected[key_name] = (layer.dtype, layer.key_shape)
        expected[value_name] = (layer.dtype, layer.value_shape)
    if set(header) != set(expected):
        raise IntegrityError(f"state {manifest.key[:12]}: payload tensors do not match the manifest's layers")
    plan: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    cursor = data_start
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        dtype, shape = expected[name]
        if entry["dtype"] != dtype or tuple(entry["shape"]) != tuple(shape):
            raise IntegrityError(f"state {manifest.key[:12]}: tensor {name} is {entry['dtype']}{entry['shape']}, manifest says {dtype}{list(shape)}")
        begin, end = (data_start + offset for offset in entry["data_offsets"])
        count = 1
        for dim in shape:
            count *= dim
        torch_dtype = _DTYPES[dtype]
        if begin != cursor or end - begin != count * torch_dtype.itemsize or end > manifest.plain_bytes:
            raise IntegrityError(f"state {manifest.key[:12]}: tensor {name} has offsets that overlap, leave holes or overrun")
        cursor = end
        plan[name] = (torch_dtype, tuple(shape), begin, end)
    if cursor != manifest.plain_bytes:
        raise IntegrityError(f"state {manifest.key[:12]}: payload has trailing bytes")
    return plan


def tensor_over(buffer: Any, dtype: torch.dtype, shape: tuple[int, ...], begin: int, end: int) -> torch.Tensor:
    """A tensor viewing bytes [begin, end) of `buffer` (no copy; kvrag never writes into it)."""
    count = (end - begin) // dtype.itemsize
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers: kvrag never writes into restored tensors
        flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=begin) if count else torch.empty(0, dtype=dtype)
    return flat.view(shape)


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def decode_payload(buffer: Any, manifest: StateManifest, chunking: PayloadChunking | None = None) -> dict[str, torch.Tensor]:
    """Tensors over the plaintext of stored `buffer` (no copy for an unencrypted one), after
    checking its chunks by `chunking` (default: the manifest's SHA-256 digests) and every header entry.

    `buffer` is any object with the buffer protocol (bytes, bytearray, mmap, memoryview), or a
    `CheckedBuffer` a store already opened by the same chunking. The returned tensors alias the
    plaintext; kvrag never writes into them (a graft concatenates into new tensors).
    """
    chunking = chunking or manifest.chunking
    size = len(buffer) if isinstance(buffer, CheckedBuffer) else memoryview(buffer).nbytes
    if not (isinstance(buffer, CheckedBuffer) and buffer.checked_by == chunking.chunk_opener.identity) and size != chunking.size:
        raise IntegrityError(f"state {manifest.key[:12]}: payload is {size} bytes, manifest says {chunking.size}")
    opened = open_payload(buffer, chunking)
    if opened is None:
        raise IntegrityError(f"state {manifest.key[:12]}: a payload chunk does not match its manifest "
                             f"({chunking.chunk_opener.name} check failed)")
    return plaintext_tensors(opened.view() if isinstance(opened, CheckedBuffer) else opened, manifest)


def plaintext_tensors(view: memoryview, manifest: StateManifest) -> dict[str, torch.Tensor]:
    """Tensors over a plaintext payload already checked or just computed here (no chunk check, every
    header entry checked against the manifest)."""
    if len(view) != manifest.plain_bytes:
        raise IntegrityError(f"state {manifest.key[:12]}: payload is {len(view)} bytes, manifest says {manifest.plain_bytes}")
    return {name: tensor_over(view, *entry) for name, entry in payload_plan(view, manifest).items()}


def header_bytes(view: memoryview) -> int:
    """How many bytes of a payload's start hold its safetensors header (after its first 8)."""
    (header_len,) = struct.unpack("<Q", view[:8])
    return 8 + min(header_len, MAX_HEADER_BYTES + 1)


def _read_header(view: memoryview, size: int) -> tuple[dict[str, dict[str, Any]], int]:
    if len(view) < 8 or size < 8:
        raise IntegrityError("payload is too short to hold a safetensors header")
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > MAX_HEADER_BYTES or 8 + header_len > min(len(view), size):
        raise IntegrityError(f"payload header claims {header_len} bytes; refusing to read it")
    raw = bytes(view[8 : 8 + header_len])
    # A genuine header nests three deep and opens about three brackets per tensor: bounding the
    # brackets bounds the nesting before the parser recurses into it.
    if raw.count(b"[") + raw.count(b"{") > 8 * MAX_LAYERS + 64:
        raise IntegrityError("payload header opens more brackets than any state's header; refusing to parse it")
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise IntegrityError(f"payload header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise IntegrityError("payload header is not a JSON object")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        if (
            not isinstance(entry, dict)
            or entry.get("dtype") not in _DTYPES
            or not isinstance(entry.get("shape"), list)
            or not all(isinstance(d, int) and 0 <= d <= MAX_TOKENS * 64 for d in entry["shape"])
            or not isinstance(entry.get("data_offsets"), list)
            or len(entry["data_offsets"]) != 2
            or not all(isinstance(o, int) and o >= 0 for o in entry["data_offsets"])
            or entry["data_offsets"][0] > entry["data_offsets"][1]
        ):
            raise IntegrityError(f"payload header entry {name!r} is malformed")
    return header, 8 + header_len
