"""The engine: deposit verified states, and answer with them grafted at their own positions.

A generation walks the prompt's schedule (see `kvrag.prompt`). For each context segment it looks
up the state whose key is that segment's content address (model fingerprint, parent key, token
ids): a state that passes every check is grafted, anything else is re-read as text in the same
segment. Because the text path feeds the same ids in the same segments, on the same hardware its
bytes equal the graft's; graft and fallback differ in time, never in answer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from pydantic import BaseModel, ConfigDict

from kvrag.approximate import rerotate_keys, rerotation_refusal, rope_inv_freq
from kvrag.artifact import (
    DepositReceipt,
    StateManifest,
    decode_payload,
    encode_payload,
    parse_manifest,
    sha256_hex,
    state_key,
    tensor_names,
)
from kvrag.digests import CHUNK_BYTES, chunk_digests
from kvrag.errors import (
    StoreError,
    StoreUnavailableError,
    ContextTooLongError,
    ForeignStateError,
    IntegrityError,
    InputError,
    StateError,
    StateNotFoundError,
    VerificationError,
)
from kvrag.fingerprints import HardwareFingerprint, hardware_fingerprint
from kvrag.kvcache import LayerSpec, StatePart, append_parts, extract_segment, layer_specs, new_cache
from kvrag.memo import Memo
from kvrag.models import LoadedModel
from kvrag.prompt import DEFAULT_SYSTEM_PROMPT, PromptLayout
from kvrag.receipt import Receipt, StateUse, Timings
from kvrag.signing import check_signature, sign_manifest, signing_key_from_env
from kvrag.stores import StateStore, open_store

log = logging.getLogger("kvrag")

__all__ = ["KVEngine", "StateRef", "Generation", "GenerationStream", "CANARY_QUESTION", "logits_sha256"]

#: The fixed probe run after every deposit: its logits after the graft must equal a fresh run's.
CANARY_QUESTION = "Which words of the text above matter most?"


class StateRef(BaseModel):
    """A JSON-safe handle on a deposited state: enough to graft it, or to re-read its text."""

    model_config = ConfigDict(frozen=True)

    key: str
    parent_key: str | None
    start: int
    token_count: int
    text: str
    model_fingerprint: str


@dataclass
class Generation:
    """An answer, its token ids, its receipt, and the first token's logits (for verification)."""

    text: str
    tokens: list[int]
    receipt: Receipt
    first_token_logits: torch.Tensor = field(repr=False)
    finish_reason: str = "stop"  # "stop": an end token or stop string; "length": max_new_tokens


@dataclass(frozen=True)
class _Segment:
    text: str
    ids: list[int]
    key: str
    parent_key: str | None
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.ids)


@dataclass(frozen=True)
class _Fetched:
    """A checked state ready to graft, the tier it came from, and what went wrong in hotter tiers."""

    manifest: StateManifest
    part: StatePart
    tier: str
    notes: str | None = None
    text_before: list[int] = field(default_factory=list)


def logits_sha256(logits: torch.Tensor) -> str:
    """SHA-256 of a logits tensor's bytes, exactly as computed (dtype kept)."""
    return sha256_hex(logits.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())


class KVEngine:
    """Deposit documents as verified KV states; generate with them grafted.

        >>> engine = KVEngine(load_model("tiny-random-llama"), "memory://")
        >>> ref = engine.deposit("Paris is the capital of France.")
        >>> engine.generate("What is the capital of France?", states=[ref]).receipt.mode
        'exact-graft'
    """

    def __init__(
        self,
        model: LoadedModel,
        store: StateStore | str | None = None,
        *,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        signing_key: bytes | str | None = None,
    ) -> None:
        self.model = model
        self.store = store if isinstance(store, StateStore) else open_store(store)
        key = signing_key if signing_key is not None else signing_key_from_env()
        self.signing_key: bytes | None = key.encode() if isinstance(key, str) else key
        self.layout = PromptLayout.for_tokenizer(model.tokenizer, system_prompt)
        self._specs: list[LayerSpec] = layer_specs(model.hf_model)
        self.memo = Memo(self)

    # ----------------------------------------------------------------- planning
    @property
    def fingerprint(self) -> str:
        return self.model.fingerprint.digest

    def hardware(self) -> HardwareFingerprint:
        return hardware_fingerprint(self.model.device)

    def plan(self, texts: Sequence[str], *, after: StateRef | None = None) -> list[_Segment]:
        """The segments (ids, keys, positions) for documents read in order, optionally after a chain."""
        segments: list[_Segment] = []
        parent = after.key if after else None
        start = after.start + after.token_count if after else 0
        for text in texts:
            ids = self.layout.segment_ids(text, first=parent is None)
            segment = _Segment(text, ids, state_key(self.fingerprint, parent, ids), parent, start)
            segments.append(segment)
            parent, start = segment.key, segment.end
        self._check_length(start)
        return segments

    def ref(self, text: str, *, after: StateRef | None = None) -> StateRef:
        """The ref a deposit of `text` would return, without computing or storing anything."""
        self._check_after(after)
        return self._ref(self.plan([text], after=after)[0])

    def deposited(self, ref: StateRef) -> bool:
        """Whether some tier holds a manifest for `ref` (cheap: the payload is not read)."""
        for tier in self.tiers:
            try:
                if tier.get_manifest(ref.key) is not None:
                    return True
            except StoreError:
                continue
        return False

    def ensure(self, text: str, *, after: StateRef | None = None) -> StateRef:
        """The ref for `text`, deposited first if no tier has it yet (what retrievers call)."""
        ref = self.ref(text, after=after)
        return ref if self.deposited(ref) else self.deposit(text, after=after)

    def resolve(self, text: str, key: str) -> StateRef | str:
        """What a framework hands over (a document's text and the state key it was retrieved with)
        as `generate` input: this engine's root ref when the key is its own, else the plain text."""
        ref = self.ref(text)
        return ref if ref.key == key else text

    def _ref(self, segment: _Segment) -> StateRef:
        return StateRef(
            key=segment.key,
            parent_key=segment.parent_key,
            start=segment.start,
            token_count=len(segment.ids),
            text=segment.text,
            model_fingerprint=self.fingerprint,
        )

    def _check_length(self, positions: int) -> None:
        limit = self.model.max_positions
        if positions > limit:
            raise ContextTooLongError(
                f"the prompt needs {positions} positions but {self.model.name} has {limit}; "
                "pass fewer or shorter documents"
            )

    def _check_after(self, after: StateRef | None) -> None:
        if after is not None and after.model_fingerprint != self.fingerprint:
            raise ForeignStateError(
                f"state {after.key[:12]} was deposited with another model (fingerprint "
                f"{after.model_fingerprint[:12]}, this engine's is {self.fingerprint[:12]}); "
                "deposit the chain again with this model"
            )

    # ------------------------------------------------------------------ compute
    def _forward(self, ids: Sequence[int], cache: Any) -> torch.Tensor:
        """One segment in one forward call; returns the last position's logits."""
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.model.device)
        with torch.inference_mode():
            out = self.model.hf_model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def _pick(self, logits: torch.Tensor) -> int:
        """Greedy choice among the ids the tokenizer has (padded vocabulary rows are never chosen)."""
        return int(torch.argmax(logits[: min(len(self.model.tokenizer), logits.shape[-1])]))

    def _canary_ids(self) -> list[int]:
        return self.layout.question_ids(CANARY_QUESTION)

    # ----------------------------------------------------------------- deposit
    def deposit(self, text: str, *, after: StateRef | None = None) -> StateRef:
        """Read `text` once, verify the state against a fresh computation, and store it.

        The state continues `after` (a chain) or starts at the prompt prefix. Idempotent: a state
        already stored under the same key is returned without recomputing. Raises `InputError`s
        for unusable text, `StateError`s for a foreign or missing parent, and `VerificationError`
        if the grafted state does not reproduce the fresh logits (nothing is stored then).
        """
        self._check_after(after)
        segment = self.plan([text], after=after)[0]
        return self._deposit_segment(segment, after.key if after else None)

    def _deposit_segment(self, segment: _Segment, after_key: str | None) -> StateRef:
        """Deposit one segment's ids after the stored chain ending at `after_key` (see `deposit`)."""
        text = segment.text
        ancestors = self._ancestors_of(after_key)
        try:
            self._fetch(segment.key, segment)
            return self._ref(segment)
        except StateError:
            pass
        began = time.perf_counter()
        canary = self._canary_ids()
        self._check_length(segment.end + len(canary))

        # Fresh computation: every segment of the chain from scratch, in the same schedule.
        fresh = new_cache(self.model.hf_model)
        for manifest, _ in ancestors:
            self._forward(manifest.token_ids, fresh)
        self._forward(segment.ids, fresh)
        layers, tensors = extract_segment(fresh, segment.start, segment.end)
        fresh_sha = logits_sha256(self._forward(canary, fresh))
        compute_ms = (time.perf_counter() - began) * 1e3

        payload = encode_payload(tensors)
        del tensors, fresh
        unverified = StateManifest(
            key=segment.key,
            parent_key=segment.parent_key,
            model_fingerprint=self.model.fingerprint,
            hardware_fingerprint=self.hardware(),
            token_ids=segment.ids,
            text_sha256=sha256_hex(text.encode()),
            start=segment.start,
            token_count=len(segment.ids),
            layers=layers,
            payload_sha256=sha256_hex(payload),
            payload_bytes=len(payload),
            payload_chunk_bytes=CHUNK_BYTES,
            payload_chunks=chunk_digests(payload, CHUNK_BYTES),
            deposit=DepositReceipt(
                canary_token_ids=canary,
                canary_logits_sha256="",
                fresh_logits_sha256=fresh_sha,
                verified=False,
                compute_ms=compute_ms,
            ),
        )
        # Graft check: the stored parents plus this state's bytes, round-tripped, must reproduce it.
        parts = [part for _, part in ancestors]
        parts.append(self._part(unverified, decode_payload(payload, unverified)))
        grafted = new_cache(self.model.hf_model)
        append_parts(grafted, parts, self.model.device)
        graft_sha = logits_sha256(self._forward(canary, grafted))
        if graft_sha != fresh_sha:
            raise VerificationError(
                f"state {segment.key[:12]} did not reproduce a fresh computation (canary logits "
                f"{graft_sha[:12]} != {fresh_sha[:12]}); nothing was stored. Check that the model "
                "runs deterministically on this device"
            )
        deposit = unverified.deposit.model_copy(update={"canary_logits_sha256": graft_sha, "verified": True})
        manifest = unverified.model_copy(update={"deposit": deposit})
        if self.signing_key is not None:
            manifest = sign_manifest(manifest, self.signing_key)
        self.store.put(segment.key, manifest.to_json_bytes(), payload)
        return self._ref(segment)

    def deposit_chain(self, texts: Sequence[str], *, after: StateRef | None = None) -> list[StateRef]:
        """Deposit documents as one chain, each state continuing the previous one."""
        refs: list[StateRef] = []
        for text in texts:
            after = self.deposit(text, after=after)
            refs.append(after)
        return refs

    def _ancestors_of(self, key: str | None) -> list[tuple[StateManifest, StatePart]]:
        """The chain ending at `key`, root first, each state fetched and checked as for a graft."""
        chain: list[tuple[StateManifest, StatePart]] = []
        while key is not None:
            fetched = self._fetch(key)
            chain.append((fetched.manifest, fetched.part))
            key = fetched.manifest.parent_key
        chain.reverse()
        return chain

    # ----------------------------------------------------------------- restore
    @property
    def tiers(self) -> list[StateStore]:
        return self.store.tiers

    def _fetch(self, key: str, expect: _Segment | None = None) -> _Fetched:
        """The first verified copy of a state, tier by tier; a verified copy found in a colder tier
        is promoted into the hotter ones. Raises the most telling `StateError` if no tier has one."""
        failures: list[tuple[str, StateError]] = []
        tiers = self.tiers
        for index, tier in enumerate(tiers):
            try:
                raw = tier.get_manifest(key)
                if raw is None:
                    raise StateNotFoundError(f"no state {key[:12]} in {tier.url}")
                manifest = self._check_manifest(key, raw, expect)
                payload = tier.get_payload(key)
                if payload is None:
                    raise StateNotFoundError(f"state {key[:12]}: its payload or a frame is missing from {tier.url}")
                part = self._part(manifest, decode_payload(payload, manifest))
            except StoreError as e:
                failures.append((tier.url, StoreUnavailableError(str(e))))
                continue
            except StateError as e:
                failures.append((tier.url, e))
                continue
            if index:
                self._promote(key, raw, payload, tiers[:index])
            notes = "; ".join(f"{url}: {e.reason}: {e}" for url, e in failures) or None
            return _Fetched(manifest, part, tier.url, notes)
        telling = [e for _, e in failures if not isinstance(e, StateNotFoundError)]
        first = (telling or [e for _, e in failures])[0]
        detail = "; ".join(f"{url}: {e}" for url, e in failures) if len(failures) > 1 else str(first)
        raise type(first)(detail) from first

    def _promote(self, key: str, manifest: bytes, payload: Any, hotter: Sequence[StateStore]) -> None:
        data = bytes(payload)
        for tier in hotter:
            try:
                tier.put(key, manifest, data)
            except StoreError as e:
                log.warning("could not promote state %s into %s: %s", key[:12], tier.url, e)

    def _check_manifest(self, key: str, raw: bytes, expect: _Segment | None = None) -> StateManifest:
        manifest = parse_manifest(raw)
        if manifest.key != key:
            raise IntegrityError(f"state {key[:12]}: manifest is for another key ({manifest.key[:12]})")
        check_signature(manifest, self.signing_key)
        if not manifest.model_fingerprint.matches(self.model.fingerprint):
            raise ForeignStateError(
                f"state {key[:12]} was made by another model ({manifest.model_fingerprint.name}, "
                f"fingerprint {manifest.model_fingerprint.digest[:12]}); this engine runs "
                f"{self.model.fingerprint.name} ({self.fingerprint[:12]})"
            )
        if not manifest.hardware_fingerprint.matches(self.hardware()):
            raise ForeignStateError(
                f"state {key[:12]} was computed on other hardware or kernels "
                f"({manifest.hardware_fingerprint.device_name}, {manifest.hardware_fingerprint.cpu_capability}, "
                f"{manifest.hardware_fingerprint.num_threads} threads); it cannot graft exactly here"
            )
        if state_key(self.fingerprint, manifest.parent_key, manifest.token_ids) != key:
            raise IntegrityError(f"state {key[:12]}: key does not match its tokens and parent")
        if expect is not None and (
            manifest.parent_key != expect.parent_key or manifest.start != expect.start or manifest.token_ids != expect.ids
        ):
            raise ForeignStateError(f"state {key[:12]} belongs to another chain or position")
        if not manifest.deposit.verified or manifest.deposit.canary_logits_sha256 != manifest.deposit.fresh_logits_sha256:
            raise IntegrityError(f"state {key[:12]} was never verified at deposit")
        self._check_layers(manifest)
        return manifest

    def _check_layers(self, manifest: StateManifest) -> None:
        if len(manifest.layers) != len(self._specs):
            raise IntegrityError(f"state {manifest.key[:12]} has {len(manifest.layers)} layers, the model {len(self._specs)}")
        for index, (entry, spec) in enumerate(zip(manifest.layers, self._specs)):
            if entry.kind != spec.kind or entry.window != spec.window:
                raise IntegrityError(f"state {manifest.key[:12]}: layer {index} is {entry.kind}, the model's is {spec.kind}")
            if entry.kind == "full":
                ok = entry.first_position == manifest.start and entry.length == manifest.token_count
            else:
                held = min(manifest.end, (spec.window or 1) - 1)
                ok = entry.length == held and entry.first_position == manifest.end - held
            if not ok or entry.key_shape[2] != entry.length or entry.value_shape[2] != entry.length:
                raise IntegrityError(
                    f"state {manifest.key[:12]}: layer {index} holds positions that do not fit its segment; "
                    "a sliding window state must hold exactly its window's tail"
                )

    def _part(self, manifest: StateManifest, tensors: dict[str, torch.Tensor]) -> StatePart:
        return StatePart(manifest.start, manifest.end, manifest.layers, tensors)

    def restore(self, ref: StateRef) -> StatePart:
        """Fetch and check one state; raises a `StateError` saying why it cannot be grafted."""
        self._check_after(ref)
        segment = self.plan([ref.text], after=None)[0] if ref.parent_key is None else None
        return self._fetch(ref.key, segment).part

    # ----------------------------------------------------------------- generate
    def generate(
        self,
        query: str,
        *,
        states: Sequence[StateRef | str] | None = None,
        max_new_tokens: int = 64,
        stop: Sequence[str] | None = None,
        graft: bool = True,
        approximate: bool = False,
        deposit_missing: bool = False,
        memo: bool = True,
    ) -> Generation:
        """Answer `query` after the documents in `states`; see `stream` for the same, token by token."""
        return self.stream(query, states=states, max_new_tokens=max_new_tokens, stop=stop, graft=graft,
                           approximate=approximate, deposit_missing=deposit_missing, memo=memo).result()

    def stream(
        self,
        query: str,
        *,
        states: Sequence[StateRef | str] | None = None,
        max_new_tokens: int = 64,
        stop: Sequence[str] | None = None,
        graft: bool = True,
        approximate: bool = False,
        deposit_missing: bool = False,
        memo: bool = True,
    ) -> "GenerationStream":
        """Iterate over the answer's text as it is decoded; `.generation` holds the result after.

        With `memo` (the default), a recurring query with a verified memo entry for the same
        context is answered from it (receipt mode `memo`); see `kvrag.memo`. Input errors are
        raised here, before the first step.
        """
        if max_new_tokens < 1:
            raise InputError("max_new_tokens must be at least 1")
        requested = list(states or [])
        texts = [r.text if isinstance(r, StateRef) else r for r in requested]
        segments = self.plan(texts)
        question = self.layout.question_ids(query)
        if not segments:
            question = list(self.layout.prefix_ids) + question
        self._check_length((segments[-1].end if segments else 0) + len(question))
        if memo and graft and not approximate and not stop:
            entry, _ = self.memo.find(query, segments)
            recalled = self.memo.recall(entry, query, segments, max_new_tokens) if entry else None
            if recalled is not None:
                return recalled
        return GenerationStream(self._steps(requested, texts, segments, question, max_new_tokens, stop or (),
                                            graft, approximate, deposit_missing))

    def _steps(
        self,
        requested: list[StateRef | str],
        texts: list[str],
        segments: list[_Segment],
        question: list[int],
        max_new_tokens: int,
        stop: Sequence[str],
        graft: bool,
        approximate: bool,
        deposit_missing: bool,
    ) -> Iterator[str]:
        """Answer `query` after the documents in `states`, grafting every state that checks out.

        `states` are refs from `deposit` (or plain document texts), in prompt order. A state is
        grafted only at its own position after its own chain; a ref placed elsewhere, or a state
        that is missing, damaged or foreign, is re-read as text and the receipt says why. With
        `graft=False` every document is re-read as text (the text-RAG arm of a comparison). With
        `approximate=True`, a ref placed elsewhere is moved there instead (keys re-rotated), and
        the receipt says `approximate-graft`, `exact=False`. With `deposit_missing`, the chain is
        deposited afterwards so the next identical ask grafts.
        """
        began = time.perf_counter()
        prompt_len = (segments[-1].end if segments else 0) + len(question)

        run = _Prefill(self)
        uses: list[StateUse] = []
        for segment, req in zip(segments, requested):
            moved = isinstance(req, StateRef) and req.key != segment.key
            requested_key = req.key if moved else None
            try:
                if not graft:
                    raise StateError("grafting was turned off for this generation")
                fetched = run.graft(self._fetch, segment.key, segment)
                uses.append(StateUse(key=segment.key, start=segment.start, end=segment.end, source="graft",
                                     tier=fetched.tier, detail=fetched.notes, requested_key=requested_key))
                continue
            except StateError as e:
                reason, detail = (e.reason if graft else "graft-off"), str(e)
            if moved and graft:
                assert isinstance(req, StateRef)
                reason, detail = "moved", (
                    f"state {req.key[:12]} was deposited at positions {req.start}..{req.start + req.token_count} after "
                    f"{'the prompt prefix' if req.parent_key is None else 'state ' + req.parent_key[:12]}; it is needed "
                    f"at {segment.start}..{segment.end}. {detail}"
                )
                if approximate:
                    try:
                        fetched = run.graft(self._moved_part, segment, req)
                        uses.append(StateUse(key=segment.key, start=segment.start, end=segment.end, source="approximate",
                                             tier=fetched.tier, reason=reason, detail=detail, requested_key=req.key))
                        continue
                    except StateError as e:
                        detail += f" Not moved either: {e}"
            run.text(segment.ids)
            uses.append(StateUse(key=segment.key, start=segment.start, end=segment.end, source="text",
                                 reason=reason, detail=detail, requested_key=requested_key))
        run.flush()
        logits = run.text(question)
        tokens = [self._pick(logits)]
        ttft_s = time.perf_counter() - began
        first_logits = logits.clone()

        t = time.perf_counter()
        text = _TextDecoder(self.model.tokenizer, self.layout.stop_ids, stop)
        yield from text.push(tokens[-1])
        limit = min(max_new_tokens, self.model.max_positions - prompt_len)
        while not text.done and len(tokens) < limit:
            tokens.append(self._pick(self._forward([tokens[-1]], run.cache)))
            yield from text.push(tokens[-1])
        yield from text.flush()
        decode_s = time.perf_counter() - t

        sources = [u.source for u in uses]
        if "approximate" in sources:
            mode = "approximate-graft"
        elif "graft" not in sources:
            mode = "text-prefill"
        else:
            mode = "exact-graft" if all(s == "graft" for s in sources) else "partial-graft"
        receipt = Receipt(
            mode=mode,
            exact=mode != "approximate-graft",
            states=uses,
            tokens_reused=run.reused,
            tokens_prefilled=run.prefilled,
            decode_tokens=len(tokens),
            timings=Timings(
                restore_ms=run.restore_s * 1e3,
                prefill_ms=run.prefill_s * 1e3,
                ttft_ms=ttft_s * 1e3,
                decode_ms=decode_s * 1e3,
                total_ms=(time.perf_counter() - began) * 1e3,
            ),
            first_token_logits_sha256=logits_sha256(first_logits),
            model_fingerprint=self.fingerprint,
            hardware_fingerprint=self.hardware().digest,
        )
        if deposit_missing and texts and any(u.source != "graft" for u in uses):
            self.deposit_chain(texts)
        return Generation(text=text.text.strip(), tokens=tokens, receipt=receipt, first_token_logits=first_logits,
                          finish_reason="stop" if text.done else "length")

    def _moved_part(self, segment: _Segment, ref: StateRef) -> _Fetched:
        """`ref`'s document K/V moved to `segment`'s position: approximate, never exact."""
        refusal = rerotation_refusal(self.model.hf_model, any(s.kind != "full" for s in self._specs))
        if refusal:
            raise ForeignStateError(refusal)
        source = self._fetch(ref.key)
        manifest = source.manifest
        doc_ids = self.layout.document_ids(segment.text)
        n = len(doc_ids)
        if manifest.token_ids[-n:] != doc_ids:
            raise ForeignStateError(f"state {ref.key[:12]} does not end with this document's tokens")
        stored = source.part.tensors
        new_start = segment.end - n
        delta = new_start - (manifest.end - n)
        inv_freq = rope_inv_freq(self.model.hf_model)
        assert inv_freq is not None
        tensors = {}
        for index in range(len(self._specs)):
            key_name, value_name = tensor_names(index)
            tensors[key_name] = rerotate_keys(stored[key_name][:, :, -n:, :], delta, inv_freq)
            tensors[value_name] = stored[value_name][:, :, -n:, :]
        part = StatePart(new_start, segment.end, manifest.layers, tensors)
        prefix = segment.ids[: len(segment.ids) - n]
        return _Fetched(manifest, part, source.tier, source.notes, prefix)


class GenerationStream:
    """The answer's text, delta by delta; after the last one, `generation` holds the result."""

    def __init__(self, steps: Iterator[str]) -> None:
        self._steps = steps
        self.generation: Generation | None = None

    def __iter__(self) -> Iterator[str]:
        self.generation = yield from self._steps

    def result(self) -> Generation:
        """Run to the end (if not already) and return the generation."""
        if self.generation is None:
            for _ in self:
                pass
        assert self.generation is not None
        return self.generation


class _TextDecoder:
    """Token ids to text deltas: whole characters only, cut at the first stop string."""

    def __init__(self, tokenizer: Any, stop_ids: frozenset[int], stop: Sequence[str]) -> None:
        self.tokenizer, self.stop_ids, self.stop = tokenizer, stop_ids, [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.done = False
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def push(self, token: int) -> Iterator[str]:
        if self.done:
            return
        if token in self.stop_ids:
            self.done = True
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            return
        text, self.done = self._cut(text)
        self.text = text
        yield from self._emit(len(text) if self.done else len(text) - self._hold)

    def _cut(self, text: str) -> tuple[str, bool]:
        """`text` up to the first stop string, and whether one was found."""
        cuts = [text.find(s) for s in self.stop if s in text]
        return (text[: min(cuts)], True) if cuts else (text, False)

    def flush(self) -> Iterator[str]:
        if not self.done:  # whatever is left, replacement characters included
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            self.text, self.done = self._cut(text)
        yield from self._emit(len(self.text))

    def _emit(self, upto: int) -> Iterator[str]:
        if upto > self.emitted:
            delta = self.text[self.emitted : upto]
            if self.emitted == 0:
                delta = delta.lstrip()
            self.emitted = upto
            if delta:
                yield delta


class _Prefill:
    """A cache being filled segment by segment: grafts are batched, text is prefilled in order."""

    def __init__(self, engine: KVEngine) -> None:
        self.engine = engine
        self.cache = new_cache(engine.model.hf_model)
        self.pending: list[StatePart] = []
        self.restore_s = self.prefill_s = 0.0
        self.reused = self.prefilled = 0

    def graft(self, fetch: Any, *args: Any) -> _Fetched:
        """Fetch a state with `fetch(*args)` (raising `StateError` to refuse) and queue it."""
        t = time.perf_counter()
        try:
            fetched: _Fetched = fetch(*args)
        finally:
            self.restore_s += time.perf_counter() - t
        if fetched.text_before:  # a moved first document: the prompt prefix is read as text
            self.text(fetched.text_before)
        self.pending.append(fetched.part)
        self.reused += fetched.part.end - fetched.part.start
        return fetched

    def flush(self) -> None:
        t = time.perf_counter()
        append_parts(self.cache, self.pending, self.engine.model.device)
        self.pending = []
        self.restore_s += time.perf_counter() - t

    def text(self, ids: Sequence[int]) -> torch.Tensor:
        self.flush()
        t = time.perf_counter()
        logits = self.engine._forward(ids, self.cache)
        self.prefill_s += time.perf_counter() - t
        self.prefilled += len(ids)
        return logits
