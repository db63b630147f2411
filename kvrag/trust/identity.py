"""An engine's identity: the model and hardware fingerprints, the namespace, and the key scope
derived from them under the signing key. Computed once, when the engine is built, and passed as a
value to everything that computes a key or checks a state.

The scope is an HMAC, under the signing key, of the model fingerprint, the hardware fingerprint and
the namespace: machines of other hardware never overwrite each other's states, and a tenant without
the key cannot compute (so cannot probe) another's keys.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kvrag.errors import ForeignStateError
from kvrag.models.fingerprints import HardwareFingerprint, ModelFingerprint, hardware_fingerprint
from kvrag.trust.signing import mac

__all__ = ["EngineIdentity", "key_scope"]


def key_scope(signing_key: bytes, model_fingerprint: str, hardware_fingerprint: str, namespace: str) -> str:
    """What every state and memo key of one engine is scoped to (see the module docstring)."""
    return mac(signing_key, b"kvrag-scope", model_fingerprint.encode(), hardware_fingerprint.encode(), namespace.encode())


@dataclass(frozen=True)
class EngineIdentity:
    """Who computes and checks states: one immutable value per engine."""

    model: ModelFingerprint
    hardware: HardwareFingerprint
    namespace: str
    scope: str
    device: str = "cpu"
    #: whether the bits depend on torch's thread count (every kernel but the invariant one)
    threads_matter: bool = True

    @classmethod
    def of(cls, model: ModelFingerprint, device: torch.device | str, signing_key: bytes, namespace: str) -> "EngineIdentity":
        """The identity of an engine running `model` on `device` now (this thread's torch settings).
        Under the invariant kernel the thread count is left out: its bits do not depend on it
        (`tests/unit/test_fingerprints.py` tries it), so a fleet of other core counts shares states."""
        threads_matter = not model.attn_implementation.startswith("invariant")
        hardware = hardware_fingerprint(device, threads_matter=threads_matter)
        scope = key_scope(signing_key, model.digest, hardware.digest, namespace)
        return cls(model, hardware, namespace, scope, str(device), threads_matter)

    @property
    def model_digest(self) -> str:
        return self.model.digest

    @property
    def scope_id(self) -> str:
        """A public name for the scope, carried by refs: it tells scopes apart and, being a hash of
        the scope, lets nobody compute a key, memo slot or record name of it."""
        return hashlib.sha256(b"kvrag-scope-id\x00" + self.scope.encode()).hexdigest()[:32]

    def check_hardware(self) -> None:
        """Raise `ForeignStateError` when this thread no longer runs as the engine was built (torch's
        thread count or flags changed since): its states would not be this computation's bytes."""
        now = hardware_fingerprint(self.device, threads_matter=self.threads_matter)
        if now.digest != self.hardware.digest:
            raise ForeignStateError(
                f"this process now runs with {now.num_threads} threads where the engine was built with "
                f"{self.hardware.num_threads} (or other torch settings); its states were made for that: build a new engine"
            )
