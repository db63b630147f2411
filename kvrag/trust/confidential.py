"""Confidential manifests and records: what a store holds of a confidential tenant reveals sizes only.

A state's manifest holds its token ids (the document itself), and a memo entry holds an answer;
both are encrypted for a confidential engine (`KVEngine(confidential=True)`, `?confidential=1`)
with AES-256-GCM under keys derived from the tenant's key, bound to the slot they were written to
(the state's key, the record's name). Inside, a manifest is signed as always, so every check that
follows is unchanged. A manifest's envelope tells a store only what it needs to frame and count
the payload (its stored size and chunk size).

A sealed or encrypted body that does not open with the reader's key (another tenant's, a damaged
one) is a `SignatureError`: a miss, answered by the text.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvrag.artifacts.payloads import derive
from kvrag.errors import SignatureError

__all__ = ["PRIVATE_MANIFEST", "PRIVATE_RECORD", "encrypt_manifest", "open_manifest", "is_private_manifest",
           "encrypt_record", "open_record", "is_private_record"]

PRIVATE_MANIFEST = "kvrag.private/1"
_MANIFEST_HEAD = b'{"format":"kvrag.private/1"'
PRIVATE_RECORD = b"kvrag.private-record/1 "
_MAX_ENVELOPE = 96 << 20


def _manifest_aead(key: bytes) -> AESGCM:
    return AESGCM(derive(key, b"kvrag-private-manifest/1"))


def _record_aead(key: bytes) -> AESGCM:
    return AESGCM(derive(key, b"kvrag-private-record/1"))


def is_private_manifest(raw: bytes) -> bool:
    return bytes(raw[: len(_MANIFEST_HEAD)]) == _MANIFEST_HEAD


def encrypt_manifest(raw: bytes, key: bytes, state_key: str, payload_bytes: int, payload_chunk_bytes: int) -> bytes:
    """Signed manifest bytes `raw`, encrypted for the slot `state_key`: a JSON envelope with the
    sizes a store frames the payload by and the ciphertext."""
    nonce = secrets.token_bytes(12)
    sealed = _manifest_aead(key).encrypt(nonce, raw, b"kvrag-manifest/1\x00" + state_key.encode())
    envelope = {"format": PRIVATE_MANIFEST, "payload_bytes": payload_bytes, "payload_chunk_bytes": payload_chunk_bytes,
                "sealed": base64.b64encode(nonce + sealed).decode()}
    return json.dumps(envelope, separators=(",", ":")).encode()


def open_manifest(raw: bytes, key: bytes, state_key: str) -> bytes:
    """The manifest bytes inside an envelope written for `state_key` under `key`; bytes that are no
    envelope are returned as they are (checked, as every manifest is, by their signature next)."""
    raw = bytes(raw)
    if not is_private_manifest(raw):
        return raw
    if len(raw) > _MAX_ENVELOPE:
        raise SignatureError(f"state {state_key[:12]}: its encrypted manifest is larger than any manifest; it is refused")
    try:
        envelope = json.loads(raw)
        blob = base64.b64decode(envelope["sealed"], validate=True)
        if set(envelope) != {"format", "payload_bytes", "payload_chunk_bytes", "sealed"} or len(blob) < 28:
            raise ValueError("not an envelope")
        return _manifest_aead(key).decrypt(blob[:12], blob[12:], b"kvrag-manifest/1\x00" + state_key.encode())
    except InvalidTag:
        raise SignatureError(f"state {state_key[:12]}: its encrypted manifest does not open with this key "
                             "(another tenant's, or altered); it is refused") from None
    except (ValueError, TypeError, KeyError, binascii.Error, RecursionError) as e:
        raise SignatureError(f"state {state_key[:12]}: its encrypted manifest is malformed ({type(e).__name__}); "
                             "it is refused") from None


def is_private_record(data: bytes) -> bool:
    return bytes(data[: len(PRIVATE_RECORD)]) == PRIVATE_RECORD


def encrypt_record(key: bytes, name: str, body: bytes) -> bytes:
    """Record `body` encrypted for slot `name`: `kvrag.private-record/1 <nonce><ciphertext+tag>`."""
    nonce = secrets.token_bytes(12)
    return PRIVATE_RECORD + nonce + _record_aead(key).encrypt(nonce, body, b"kvrag-record/1\x00" + name.encode())


def open_record(key: bytes, name: str, data: bytes) -> bytes:
    """The body of a record encrypted for slot `name` under `key`; `SignatureError` otherwise."""
    blob = bytes(data)[len(PRIVATE_RECORD):]
    if len(blob) < 28:
        raise SignatureError(f"{name} is an encrypted record too short to hold one; it is refused")
    try:
        return _record_aead(key).decrypt(blob[:12], blob[12:], b"kvrag-record/1\x00" + name.encode())
    except InvalidTag:
        raise SignatureError(f"{name} does not open with this key and slot (another tenant's, or altered); "
                             "it is refused") from None
