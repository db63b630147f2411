"""Depositing: read a segment once after its verified ancestors, verify the state, store it.

The segment is prefilled after its ancestors' grafted states (already verified, so their bytes
are a fresh computation's; `kvrag verify` re-checks this against a from-scratch run), its K/V are
extracted, and the state is verified by the canary: the canary question's logits after grafting
the stored bytes must equal its logits after the fresh prefill, SHA-256 for SHA-256. Only then is
the manifest (fingerprints, digests, the deposit receipt) signed and written, after the payload.
The payload is stored with keyed per-chunk tags, or encrypted for a confidential engine (see
`kvrag.artifacts.payloads`); its SHA-256 is computed here, once, as the exactness record.
A chain therefore costs one prefill per state, not one per ancestor. Under the invariant kernel
each new state is also indexed by its prefix (`kvrag.core.prefixes`), so any prompt that begins
with its tokens finds it.

The canary compares a state with the computation that made it, so a computation that went wrong
would pass it. A chain deposited after an answer that read it is also checked against that answer,
an independent computation: grafting the new states and reading the answer's question must give
the answer's first-token logits, bit for bit, before anything of the chain is stored (`Answered`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvrag.artifacts.digests import chunk_digests
from kvrag.artifacts.format import DepositReceipt, StateManifest, encode_payload, plaintext_tensors, sha256_hex
from kvrag.artifacts.payloads import seal_payload
from kvrag.codecs import StatePart, extract, install
from kvrag.core.acceptance import Restored
from kvrag.core.batching import Batching
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
from kvrag.trust.signing import sign_manifest

__all__ = ["CANARY_QUESTION", "Depositor", "Answered"]

#: The fixed probe run after every deposit: its logits after the graft must equal a fresh run's.
CANARY_QUESTION = "Which words of the text above matter most?"


@dataclass(frozen=True)
class Answered:
    """An answer given after the chain being deposited: the ids it read after the chain (its
    question) and its first-token logits' SHA-256."""

    feed: tuple[int, ...]
    first_token_logits_sha256: str


@dataclass
class _Prepared:
    """A state computed and verified by its canary, not written yet."""

    segment: Segment
    restored: Restored
    stored: Any
    prefix_ids: list[int] = field(default_factory=list)


#: the most prompt rows one piece of a deposit's read adds to a batch forward (see `Depositor._read`)
DEPOSIT_READ_ROWS = 64


class Depositor:
    """Deposits segments after their stored chains: computed once, verified, signed, stored."""

    def __init__(self, runner: ModelRunner, planner: Planner, store: StateStore, restorer: Restorer,
                 identity: EngineIdentity, signing_key: bytes, *, deadline_s: float,
                 whereabouts: Whereabouts | None = None, prefixes: PrefixRecords | None = None,
                 confidential: bool = False, batching: Batching | None = None) -> None:
        self.runner, self.planner, self.store, self.restorer = runner, planner, store, restorer
        self.identity, self.signing_key, self.deadline_s = identity, signing_key, deadline_s
        self.whereabouts, self.prefixes, self.confidential = whereabouts, prefixes, confidential
        #: chains checked against the answer they were read for, and those refused by the check
        self.answers_checked = self.answers_refused = 0
        #: the model's batch, when it has one (`kvrag serve`): a deposit's reads join its forwards
        self.batching = batching or Batching()

    def canary_ids(self) -> list[int]:
        return self.planner.layout.question_ids(CANARY_QUESTION)

    def extend(self, segments: Sequence[Segment], answered: Answered | None = None) -> list[Restored]:
        """Deposit `segments` in order, each continuing the one before, the first after its stored
        parent chain; a segment stored already is read, not computed again. With `answered` (an
        answer given after exactly this chain), nothing is stored unless the new states reproduce
        that answer (`VerificationError`). Returns the states deposited now."""
        if not segments:
            return []
        chain = self.restorer.chain(segments[0].parent_key, Deadline(self.deadline_s))
        ancestors: list[StatePart] = [r.part for r in chain]
        # the prompt's ids so far, kept only where prefix records need them
        before = [t for r in chain for t in r.manifest.token_ids] if self.prefixes is not None else []
        prepared: list[_Prepared] = []
        for segment in segments:
            try:
                ancestors.append(self.restorer.fetch(segment.key, segment, Deadline(self.deadline_s)).value.part)
            except StateError:
                prepared.append(self._prepare(segment, ancestors))
                prepared[-1].prefix_ids = [*before, *segment.ids] if self.prefixes is not None else []
                ancestors.append(prepared[-1].restored.part)
                if answered is None:
                    self._write(prepared[-1])
            if self.prefixes is not None:
                before.extend(segment.ids)
        if answered is not None and prepared:
            self._check_answer(ancestors, answered, segments[-1])
            for one in prepared:
                self._write(one)
        return [one.restored for one in prepared]

    def _check_answer(self, chain: Sequence[StatePart], answered: Answered, last: Segment) -> None:
        """The chain grafted, then the answer's question read: its logits must be the answer's."""
        cache = self.runner.new_cache()
        install(self.runner.codecs, cache, chain, self.runner.device)
        sha = logits_sha256(self._read(list(answered.feed), cache))
        cache.release()
        self.answers_checked += 1
        if sha != answered.first_token_logits_sha256:
            self.answers_refused += 1
            raise VerificationError(
                f"the chain ending in state {last.key[:12]} did not reproduce the answer it was read for (first-token "
                f"logits {sha[:12]} != {answered.first_token_logits_sha256[:12]}); nothing of it was stored")

    def _read(self, ids: Sequence[int], cache: Any) -> torch.Tensor:
        """One read of a deposit: where the model has a batch, in its background (a forward no answer
        waits on, or beside the answers' rows once it has waited: `kvrag.core.batching`), in pieces
        of `DEPOSIT_READ_ROWS` where reads are packed (under the invariant kernel a read in pieces
        has the bits of one read), so no forward carries much of it; else a forward of its own. In
        the model's turn either way; a thread that holds the model already reads in its own turn."""
        batcher = self.batching.batcher
        if batcher is None or self.runner.model.turns.held:
            return self.runner.forward(ids, cache)
        size = DEPOSIT_READ_ROWS if self.runner.packs_reads else max(len(ids), 1)
        with batcher.lane(background=True) as lane:
            for first in range(0, len(ids), size):
                logits = lane.read(ids[first : first + size], cache)
        return logits

    def ensure(self, segment: Segment) -> None:
        """Deposit `segment` unless some tier holds it whole already."""
        if not self.restorer.holds(segment.key, Deadline(self.deadline_s)):
            self.extend([segment])

    def deposit(self, segment: Segment, ancestors: Sequence[StatePart]) -> Restored:
        """Compute, verify and store `segment`'s state after `ancestors` (its chain, root first, checked).

        Returns the state as grafted in the verification, ready to be the next deposit's ancestor.
        Raises `VerificationError` (nothing stored) when the grafted state does not reproduce it.
        """
        prepared = self._prepare(segment, ancestors)
        self._write(prepared)
        return prepared.restored

    def _prepare(self, segment: Segment, ancestors: Sequence[StatePart]) -> _Prepared:
        """`segment`'s state computed after `ancestors` and verified by the canary, ready to write."""
        self.identity.check_hardware()
        canary = self.canary_ids()
        self.planner.check_length(segment.end + len(canary))
        payload, stored, unverified = self._compute(segment, ancestors, canary)
        # Graft check: the ancestors plus this state's bytes, round-tripped, must reproduce it.
        # (the payload was computed just now: its header is checked, its bytes need no check)
        part = StatePart(segment.start, segment.end, unverified.layers, plaintext_tensors(memoryview(payload), unverified))
        grafted = self.runner.new_cache()
        install(self.runner.codecs, grafted, [*ancestors, part], self.runner.device)
        graft_sha = logits_sha256(self._read(canary, grafted))
        fresh_sha = unverified.deposit.fresh_logits_sha256
        if graft_sha != fresh_sha:
            raise VerificationError(
                f"state {segment.key[:12]} did not reproduce a fresh computation (canary logits "
                f"{graft_sha[:12]} != {fresh_sha[:12]}); nothing was stored. Check that the model "
                "runs deterministically on this device"
            )
        deposit = unverified.deposit.model_copy(update={"canary_logits_sha256": graft_sha, "verified": True})
        manifest = sign_manifest(unverified.model_copy(update={"deposit": deposit}), self.signing_key)
        return _Prepared(segment, Restored(manifest, part), stored)

    def _write(self, prepared: _Prepared) -> None:
        """Store a prepared state (payload, then manifest), then index it by its prefix."""
        self._store(prepared.segment, prepared.restored.manifest, prepared.stored)
        if self.prefixes is not None and prepared.prefix_ids:
            self.prefixes.record(prepared.prefix_ids, prepared.segment.start, prepared.segment.key)

    def _compute(self, segment: Segment, ancestors: Sequence[StatePart],
                 canary: list[int]) -> tuple[bytes, Any, StateManifest]:
        """The segment's payload prefilled after `ancestors`, as computed and as stored (sealed), and
        its manifest before verification."""
        runner = self.runner
        began = time.perf_counter()
        fresh = runner.new_cache()
        install(runner.codecs, fresh, ancestors, runner.device)
        self._read(segment.ids, fresh)
        layers, tensors = extract(runner.codecs, fresh, segment.start, segment.end)
        fresh_sha = logits_sha256(self._read(canary, fresh))
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
