"""HMAC-SHA256 signatures on manifests: a shared store is a trust boundary.

States steer a model invisibly, so anyone who can write to a shared Redis could plant one. With a
signing key (`KVRAG_SIGNING_KEY`, or `KVEngine(signing_key=...)`), every deposit is signed and
every graft requires a valid signature; an unsigned or wrongly signed state is refused, logged,
and re-read as text. The payload is covered through the manifest's payload SHA-256.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os

from kvrag.artifact import StateManifest
from kvrag.errors import SignatureError

__all__ = ["signing_key_from_env", "sign_manifest", "check_signature"]

log = logging.getLogger("kvrag.signing")


def signing_key_from_env() -> bytes | None:
    key = os.environ.get("KVRAG_SIGNING_KEY")
    return key.encode() if key else None


def _mac(manifest: StateManifest, key: bytes) -> str:
    unsigned = manifest.model_copy(update={"signature": None}).model_dump_json().encode()
    return hmac.new(key, unsigned, hashlib.sha256).hexdigest()


def sign_manifest(manifest: StateManifest, key: bytes) -> StateManifest:
    return manifest.model_copy(update={"signature": _mac(manifest, key)})


def check_signature(manifest: StateManifest, key: bytes | None) -> None:
    """Raise `SignatureError` (and log it) unless the manifest is validly signed; no key, no check."""
    if key is None:
        return
    if manifest.signature is None:
        log.warning("refused unsigned state %s (a signing key is configured)", manifest.key[:12])
        raise SignatureError(f"state {manifest.key[:12]} is unsigned and a signing key is configured; it is refused")
    if not hmac.compare_digest(manifest.signature, _mac(manifest, key)):
        log.warning("refused state %s: its signature does not match", manifest.key[:12])
        raise SignatureError(f"state {manifest.key[:12]} has a signature that does not match; it is refused")
