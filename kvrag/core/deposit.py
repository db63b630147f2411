"""Depositing: read a segment once after its verified ancestors, verify the state, store it.

The segment is prefilled after its ancestors' grafted states (already verified, so their bytes
are a fresh computation's; `kvrag verify` re-checks this against a from-scratch run), its K/V are
extracted, and the state is verified by the canary: the canary question's logits after grafting
the stored bytes must equal its logits after the fresh prefill, SHA-256 for SHA-256. Only then is
the manifest (fingerprints, digests, the deposit receipt) signed and written, after the payload.
The payload is stored with keyed per-chunk tags, or encrypted for a confidential engine (see
`kvrag.trust.payloads`); its SHA-256 is computed here, once, as the exactness record.
A chain therefore costs one prefill per state, not one per ancestor. Under the invariant kernel
each new state is also indexed by its prefix (`kvrag.core.prefixes`), so any prompt that begins
with its tokens finds it.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from kvrag.artifacts.digests import chunk_digests
from kvrag.artifacts.format import DepositReceipt, StateManifest, encode_payload, plaintext_tensors, sha256_hex
from kvrag.codecs import StatePart, extract, install
from kvrag.core.acceptance import Restored
from kvrag.core.prefixes import PrefixRecords
from kvrag.core.restore import Restorer
from kvrag.core.runner import ModelRunner, logits_sha256
from kvrag.core.schedule import Planner, Segment
from kvrag.core.whereabouts import Whereabouts
from kvrag.errors import StateError, VerificationError
from kvrag.stores import StateStore
from kvrag.stores.deadline import Deadline
from kvrag.trust.confidential import encrypt_manifest
from kvrag.trust.identity import EngineIdentity
from kvrag.trust.payloads import seal_payload
from kvrag.trust.signing import sign_manifest

__all__ = ["CANARY_QUESTION", "Depositor"]

#: The fixed probe run after every deposit: its logits after the graft must equal a fresh run's.
CANARY_QUESTION = "Which words of the text above matter most?"


class Depositor:
    """Deposits segments after their stored chains: computed once, verified, signed, stored."""

    def __init__(self, runner: ModelRunner, planner: Planner, store: StateStore, restorer: Restorer,
                 identity: EngineIdentity, signing_key: bytes, *, deadline_s: float,
                 whereabouts: Whereabouts | None = None, prefixes: PrefixRecords | None = None,
                 confidential: bool = False) -> None:
        self.runner, self.planner, self.store, self.restorer = runner, planner, store, restorer
        self.identity, self.signing_key, self.deadline_s = identity, signing_key, deadline_s
        self.whereabouts, self.prefixes, self.confidential = whereabouts, prefixes, confidential

    def canary_ids(self) -> list[int]:
        return self.planner.layout.question_ids(CANARY_QUESTION)

    def extend(self, segments: Sequence[Segment]) -> list[Restored]:
        """Deposit `segments` in order, each continuing the one before, the first after its stored
        parent chain; a segment stored already is read, not computed again. Returns the states
        deposited now."""
        if not segments:
            return []
        chain = self.restorer.chain(segments[0].parent_key, Deadline(self.deadline_s))
        ancestors: list[StatePart] = [r.part for r in chain]
        # the prompt's ids so far, kept only where prefix records need them
        before = [t for r in chain for t in r.manifest.token_ids] if self.prefixes is not None else []
        deposited: list[Restored] = []
        for segment in segments:
            try:
                ancestors.append(self.restorer.fetch(segment.key, segment, Deadline(self.deadline_s)).value.part)
            except StateError:
                deposited.append(self.deposit(segment, ancestors))
                ancestors.append(deposited[-1].part)
                if self.prefixes is not None:
                    self.prefixes.record([*before, *segment.ids], segment.start, segment.key)
            if self.prefixes is not None:
                before.extend(segment.ids)
        return deposited

    def ensure(self, segment: Segment) -> None:
        """Deposit `segment` unless some tier holds it whole already."""
        if not self.restorer.holds(segment.key, Deadline(self.deadline_s)):
            self.extend([segment])

    def deposit(self, segment: Segment, ancestors: Sequence[StatePart]) -> Restored:
        """Compute, verify and store `segment`'s state after `ancestors` (its chain, root first, checked).

        Returns the state as grafted in the verification, ready to be the next deposit's ancestor.
        Raises `VerificationError` (nothing stored) when the grafted state does not reproduce it.
        """
        self.identity.check_hardware()
        canary = self.canary_ids()
        self.planner.check_length(segment.end + len(canary))
        payload, stored, unverified = self._compute(segment, ancestors, canary)
        # Graft check: the ancestors plus this state's bytes, round-tripped, must reproduce it.
        # (the payload was computed just now: its header is checked, its bytes need no check)
        part = StatePart(segment.start, segment.end, unverified.layers, plaintext_tensors(memoryview(payload), unverified))
        grafted = self.runner.new_cache()
        install(self.runner.codecs, grafted, [*ancestors, part], self.runner.device)
        graft_sha = logits_sha256(self.runner.forward(canary, grafted))
        fresh_sha = unverified.deposit.fresh_logits_sha256
        if graft_sha != fresh_sha:
            raise VerificationError(
                f"state {segment.key[:12]} did not reproduce a fresh computation (canary logits "
                f"{graft_sha[:12]} != {fresh_sha[:12]}); nothing was stored. Check that the model "
                "runs deterministically on this device"
            )
        deposit = unverified.deposit.model_copy(update={"canary_logits_sha256": graft_sha, "verified": True})
        manifest = sign_manifest(unverified.model_copy(update={"deposit": deposit}), self.signing_key)
        self._store(segment, manifest, stored)
        return Restored(manifest, part)

    def _compute(self, segment: Segment, ancestors: Sequence[StatePart],
                 canary: list[int]) -> tuple[bytes, Any, StateManifest]:
        """The segment's payload prefilled after `ancestors`, as computed and as stored (sealed), and
        its manifest before verification."""
        runner = self.runner
        began = time.perf_counter()
        fresh = runner.new_cache()
        install(runner.codecs, fresh, ancestors, runner.device)
        runner.forward(segment.ids, fresh)
        layers, tensors = extract(runner.codecs, fresh, segment.start, segment.end)
        fresh_sha = logits_sha256(runner.forward(canary, fresh))
        compute_ms = (time.perf_counter() - began) * 1e3
        payload = encode_payload(tensors)
        del tensors, fresh
        chunk_bytes = self.store.chunk_bytes
        stored, seal = seal_payload(payload, self.signing_key, segment.key, chunk_bytes, confidential=self.confidential)
        return payload, stored, StateManifest(
            key=segment.key,
            parent_key=segment.parent_key,
            model_fingerprint=runner.model.fingerprint,
            hardware_fingerprint=self.identity.hardware,
            token_ids=segment.ids,
            text_sha256=sha256_hex(segment.text.encode()),
            start=segment.start,
            token_count=len(segment.ids),
            layers=layers,
            payload_sha256=sha256_hex(payload),
            payload_bytes=len(stored),
            payload_chunk_bytes=chunk_bytes,
            payload_chunks=chunk_digests(stored, chunk_bytes),
            prompt_layout=segment.layout or None,
            payload_seal=seal,
            deposit=DepositReceipt(canary_token_ids=canary, canary_logits_sha256="", fresh_logits_sha256=fresh_sha,
                                   verified=False, compute_ms=compute_ms),
        )

    def _store(self, segment: Segment, manifest: StateManifest, stored: Any) -> None:
        """Write the payload, then the manifest (encrypted for a confidential engine)."""
        raw = manifest.to_json_bytes()
        if self.confidential:
            raw = encrypt_manifest(raw, self.signing_key, segment.key, manifest.payload_bytes, manifest.payload_chunk_bytes)
        self.store.put(segment.key, raw, stored)
        if self.whereabouts is not None:
            self.whereabouts.note(segment)
