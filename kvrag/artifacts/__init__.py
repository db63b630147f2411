"""A stored state's bytes: the manifest and safetensors payload (`format`) and the chunked SHA-256
checks a payload is read under (`digests`). Tensors become bytes only here."""

from kvrag.artifacts.digests import CHUNK_BYTES, CheckedBuffer, PayloadChunking, chunk_digests
from kvrag.artifacts.format import FORMAT, DepositReceipt, LayerEntry, StateManifest, parse_manifest, state_key

__all__ = ["StateManifest", "LayerEntry", "DepositReceipt", "FORMAT", "parse_manifest", "state_key", "CHUNK_BYTES",
           "PayloadChunking", "CheckedBuffer", "chunk_digests"]
