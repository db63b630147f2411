"""State acceptance: every check a stored state must pass before it may be grafted.

In order, before any payload byte is read: the manifest's stored bytes open with this engine's key
(when they are encrypted, `kvrag.trust.confidential`) and are signed with this
engine's key (unsigned only where the reader opted in), they parse, are for the key asked for, were made by this model on
this hardware, its token ids are in the model's vocabulary, its key is the content address of its
own tokens and parent, it sits at the position and after the chain it is needed at, it was
verified at deposit, and each layer's entry fits its codec. Then the payload:
each chunk by its keyed tag or AEAD tag (`kvrag.artifacts.payloads`; the SHA-256 digests of
a manifest that names neither) as it arrives, and every tensor header against the manifest. A failed check raises the
`StateError` whose `reason` the receipt will name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvrag.artifacts.format import StateManifest, decode_payload, parse_manifest, state_key
from kvrag.artifacts.payloads import chunking_of
from kvrag.codecs import LayerCodec, StatePart
from kvrag.core.schedule import Segment
from kvrag.errors import ForeignStateError, IntegrityError, SignatureError
from kvrag.models.fingerprints import HardwareFingerprint
from kvrag.stores import Accepted, StateStore
from kvrag.trust.confidential import open_manifest
from kvrag.trust.identity import EngineIdentity
from kvrag.trust.signing import check_manifest_bytes

__all__ = ["Restored", "StateAcceptance"]


@dataclass(frozen=True)
class Restored:
    """A state that passed every check: its manifest and its tensors, ready to graft."""

    manifest: StateManifest
    part: StatePart


class StateAcceptance:
    """The checks for one model on one machine, with one signing key (or none)."""

    def __init__(self, identity: EngineIdentity, codecs: Sequence[LayerCodec], signing_key: bytes,
                 vocabulary: int, *, allow_unsigned: bool = False) -> None:
        self.identity = identity
        self.model = identity.model
        self.codecs = list(codecs)
        self.signing_key = signing_key
        self.vocabulary = vocabulary
        self.allow_unsigned = allow_unsigned

    def expecting(self, key: str, segment: Segment | None = None) -> "_BoundAcceptance":
        """The check for the state under `key`, needed as `segment` (or anywhere, for ancestors).

        Whether this thread still runs as the engine was built is asked here, on the caller's
        thread (a store may run the check on a worker thread, where thread counts read differently)."""
        self.identity.check_hardware()
        return _BoundAcceptance(self, key, segment, self.identity.hardware, self.identity.scope)

    def manifest(self, key: str, raw: bytes, expect: Segment | None, hardware: HardwareFingerprint, scope: str,
                 store: StateStore | None = None) -> StateManifest:
        allow = self.allow_unsigned or bool(store is not None and store.allow_unsigned)
        raw = open_manifest(raw, self.signing_key, key)
        try:
            signature = check_manifest_bytes(raw, self.signing_key, allow_unsigned=allow, where=store.url if store else "")
        except SignatureError as e:
            raise SignatureError(f"state {key[:12]}: {e}") from e
        manifest = parse_manifest(raw)
        if manifest.signature != signature:  # the bytes checked and the manifest parsed must agree
            raise IntegrityError(f"state {key[:12]}: its manifest parses to another signature than its bytes carry")
        if manifest.key != key:
            raise IntegrityError(f"state {key[:12]}: manifest is for another key ({manifest.key[:12]})")
        if not manifest.model_fingerprint.matches(self.model):
            raise ForeignStateError(
                f"state {key[:12]} was made by another model ({manifest.model_fingerprint.name}, "
                f"fingerprint {manifest.model_fingerprint.digest[:12]}); this engine runs "
                f"{self.model.name} ({self.model.digest[:12]})"
            )
        if not manifest.hardware_fingerprint.matches(hardware):
            raise ForeignStateError(
                f"state {key[:12]} was computed on other hardware or kernels "
                f"({manifest.hardware_fingerprint.device_name}, {manifest.hardware_fingerprint.cpu_capability}, "
                f"{manifest.hardware_fingerprint.num_threads or 'any number of'} threads); it cannot graft exactly here"
            )
        if any(t >= self.vocabulary for t in manifest.token_ids):
            raise IntegrityError(f"state {key[:12]} holds token ids outside the model's vocabulary of {self.vocabulary}")
        if state_key(scope, manifest.parent_key, manifest.token_ids) != key:
            raise IntegrityError(f"state {key[:12]}: key does not match its tokens and parent")
        if expect is not None and (
            manifest.parent_key != expect.parent_key or manifest.start != expect.start or manifest.token_ids != expect.ids
        ):
            raise ForeignStateError(f"state {key[:12]} belongs to another chain or position")
        if not manifest.deposit.verified or manifest.deposit.canary_logits_sha256 != manifest.deposit.fresh_logits_sha256:
            raise IntegrityError(f"state {key[:12]} was never verified at deposit")
        self.layers(manifest)
        return manifest

    def layers(self, manifest: StateManifest) -> None:
        if len(manifest.layers) != len(self.codecs):
            raise IntegrityError(f"state {manifest.key[:12]} has {len(manifest.layers)} layers, the model {len(self.codecs)}")
        for index, (entry, codec) in enumerate(zip(manifest.layers, self.codecs)):
            why = codec.refusal(entry, manifest.start, manifest.end)
            if why:
                raise IntegrityError(f"state {manifest.key[:12]}: layer {index} {why}")

    def payload_chunking(self, manifest: StateManifest) -> Any:
        """How this engine checks the manifest's payload (its keyed tags or AEAD, with this key)."""
        return chunking_of(manifest, self.signing_key)

    def payload(self, manifest: StateManifest, payload: Any) -> Restored:
        tensors = decode_payload(payload, manifest, self.payload_chunking(manifest))
        return Restored(manifest, StatePart(manifest.start, manifest.end, manifest.layers, tensors, source=payload))


@dataclass(frozen=True)
class _BoundAcceptance:
    """`StateAcceptance` bound to one key and position, as a store's `Acceptance`."""

    acceptance: StateAcceptance
    key: str
    expect: Segment | None
    hardware: HardwareFingerprint
    scope: str

    def manifest(self, raw: bytes, store: StateStore) -> Accepted:
        manifest = self.acceptance.manifest(self.key, raw, self.expect, self.hardware, self.scope, store)
        return Accepted(manifest, self.acceptance.payload_chunking(manifest))

    def payload(self, manifest: StateManifest, payload: Any) -> Restored:
        return self.acceptance.payload(manifest, payload)
