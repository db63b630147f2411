"""Per-read checks of a payload's chunks under the signing key: keyed BLAKE3 tags, or AES-256-GCM.

SHA-256 of every 8 MiB chunk was the slowest step of a restore (about 1.2 GiB/s here). A state
written now carries, in its signed manifest, one keyed BLAKE3 tag per stored chunk (several GiB/s
per core), bound to the state's key and the chunk's index: a chunk flipped, moved to another index
or copied from another state fails its tag, as it failed its SHA-256. An attacker without the key
can forge neither; one with it can already sign anything.

A confidential state (`KVEngine(confidential=True)`, `?confidential=1`) stores each chunk
encrypted with AES-256-GCM instead, under a key derived for the state from the tenant's key and a
random nonce, the chunk's index and the state's key as associated data: the AEAD tag is the
per-read check, and a reader without the key learns only sizes. The payload's SHA-256 (of its
plaintext) stays in the manifest as the exactness record, computed once at deposit.
"""

from __future__ import annotations

import hmac
import secrets
import struct
from functools import lru_cache
from typing import Any, Protocol, Sequence

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvrag.artifacts.digests import CHUNK_BYTES, CheckedBuffer, ChunkOpener, PayloadChunking, hash_pool
from kvrag.artifacts.format import AEAD_TAG_BYTES, PayloadSeal, StateManifest

__all__ = ["KeyedTags", "AeadChunks", "Sealed", "seal_payload", "chunking_of", "derive"]

_TAGGED = "blake3-keyed/1"
_SEALED = "aes-256-gcm/1"


@lru_cache(maxsize=64)
def derive(key: bytes, purpose: bytes, salt: bytes = b"kvrag/1") -> bytes:
    """A 32-byte key for one purpose, derived from the signing key (HKDF-SHA256)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=purpose).derive(key)


@lru_cache(maxsize=256)
def _key_id(key: bytes) -> bytes:
    """A name for a derived key that reveals nothing of it."""
    return blake3.blake3(b"kvrag-key-id/1", key=key).digest()


def _chunk_header(state_key: str, index: int, length: int) -> bytes:
    return b"kvrag-chunk/1\x00" + state_key.encode() + struct.pack("<QQ", index, length)


class KeyedTags(ChunkOpener):
    """Each stored chunk's keyed BLAKE3 tag, bound to the state's key and the chunk's index."""

    name = _TAGGED

    def __init__(self, signing_key: bytes, state_key: str, tags: tuple[str, ...] = ()) -> None:
        self._key = derive(signing_key, b"kvrag-chunk-tags/1")
        self.state_key = state_key
        self.tags = tuple(tags)

    @property
    def identity(self) -> tuple[Any, ...]:
        # names the key too: bytes checked under one key are never taken as checked under another
        # whose manifest lists the same tags
        return (_TAGGED, _key_id(self._key), self.state_key, self.tags)

    def tag(self, index: int, *pieces: Any) -> str:
        """The tag of chunk `index`, whose bytes are `pieces` in order (usually one)."""
        views = [memoryview(piece).cast("B") for piece in pieces]
        digest = blake3.blake3(_chunk_header(self.state_key, index, sum(len(v) for v in views)), key=self._key)
        for view in views:
            digest.update(view)
        return digest.hexdigest()

    def open(self, index: int, stored: memoryview, out: memoryview) -> bool:
        return self.check(index, [stored])

    def check(self, index: int, pieces: Sequence[memoryview]) -> bool:
        return index < len(self.tags) and hmac.compare_digest(self.tag(index, *pieces), self.tags[index])


class AeadChunks(ChunkOpener):
    """Each stored chunk is its plaintext chunk under AES-256-GCM, its tag appended: opening it
    checks and decrypts it into the plaintext buffer."""

    name = _SEALED
    in_place = False
    overhead = AEAD_TAG_BYTES

    def __init__(self, signing_key: bytes, state_key: str, nonce: bytes, count: int, stored_chunks: tuple[str, ...] = ()) -> None:
        key = derive(derive(signing_key, b"kvrag-confidential/1"), state_key.encode(), salt=nonce)
        self._aead, self._key_id = AESGCM(key), _key_id(key)
        self.state_key, self.nonce, self.count = state_key, nonce, count
        self.stored_chunks = tuple(stored_chunks)

    @property
    def identity(self) -> tuple[Any, ...]:
        return (_SEALED, self._key_id, self.state_key, self.nonce, self.count, self.stored_chunks)

    def _aad(self, index: int) -> bytes:
        return _chunk_header(self.state_key, index, self.count)

    def seal_into(self, index: int, plain: memoryview, out: memoryview) -> None:
        self._aead.encrypt_into(index.to_bytes(12, "little"), plain, self._aad(index), out)

    def open(self, index: int, stored: memoryview, out: memoryview) -> bool:
        if index >= self.count or len(out) != len(stored) - AEAD_TAG_BYTES:
            return False
        try:
            self._aead.decrypt_into(index.to_bytes(12, "little"), stored, self._aad(index), out)
        except (InvalidTag, ValueError):
            return False
        return True


def seal_payload(plain: Any, signing_key: bytes, state_key: str, chunk_bytes: int = CHUNK_BYTES, *,
                 confidential: bool = False) -> tuple[Any, PayloadSeal]:
    """The bytes to store for payload `plain` in `chunk_bytes` stored chunks, and the seal its
    manifest records: keyed tags over the plaintext as it is, or (confidential) each chunk
    encrypted. Work runs on the hashing threads."""
    view = memoryview(plain).cast("B")
    if not confidential:
        tagger = KeyedTags(signing_key, state_key)
        chunks = [view[i : i + chunk_bytes] for i in range(0, len(view), chunk_bytes)]
        tags = list(hash_pool().map(lambda job: tagger.tag(*job), enumerate(chunks)))
        return plain, PayloadSeal(scheme=_TAGGED, tags=tags)
    if chunk_bytes <= AEAD_TAG_BYTES:
        raise ValueError("an encrypted state's chunks must be larger than the AEAD tag")
    plain_chunk = chunk_bytes - AEAD_TAG_BYTES
    count = -(-len(view) // plain_chunk)
    nonce = secrets.token_bytes(16)
    sealer = AeadChunks(signing_key, state_key, nonce, count)
    stored = CheckedBuffer(len(view) + AEAD_TAG_BYTES * count)
    out = stored.view()

    def seal_one(index: int) -> None:
        part = view[index * plain_chunk : (index + 1) * plain_chunk]
        at = index * chunk_bytes
        sealer.seal_into(index, part, out[at : at + len(part) + AEAD_TAG_BYTES])

    list(hash_pool().map(seal_one, range(count)))
    return stored, PayloadSeal(scheme=_SEALED, nonce=nonce.hex(), plain_bytes=len(view), plain_chunk_bytes=plain_chunk)


class Sealed(Protocol):
    """A signed manifest of a sealed payload: a state's, or a paged engine's block's."""

    @property
    def key(self) -> str: ...
    @property
    def payload_seal(self) -> PayloadSeal | None: ...
    @property
    def chunking(self) -> PayloadChunking: ...
    @property
    def plain_bytes(self) -> int: ...


def chunking_of(manifest: StateManifest | Sealed, signing_key: bytes) -> PayloadChunking:
    """How a reader holding `signing_key` checks the manifest's payload: by its keyed tags, by its
    AEAD, or (a manifest that names neither) by its chunks' SHA-256 digests."""
    seal = manifest.payload_seal
    base = manifest.chunking
    if seal is None:
        return base
    if seal.scheme == _TAGGED:
        opener: ChunkOpener = KeyedTags(signing_key, manifest.key, tuple(seal.tags))
        return PayloadChunking(base.size, base.chunk_bytes, base.chunks, opener)
    assert seal.nonce is not None
    opener = AeadChunks(signing_key, manifest.key, bytes.fromhex(seal.nonce), base.count, tuple(base.chunks))
    return PayloadChunking(base.size, base.chunk_bytes, base.chunks, opener, manifest.plain_bytes)
