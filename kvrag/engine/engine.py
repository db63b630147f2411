"""The engine: a facade that wires the parts a query passes through.

    identity (kvrag.trust.identity)  model and hardware fingerprints, namespace, key scope: once
    schedule (kvrag.core.schedule)   documents and question -> segments with content-addressed keys
    transcript                       or a whole formatted prompt (chat messages) -> the same, cut by
    (kvrag.core.transcript)          content (message ends, line ends), for drop-in pipelines
    memo (kvrag.reuse.memo)          a recurring query -> the continuation that answers from its
                                     verified memo state (or none)
    restore (kvrag.core.restore)     each segment's state fetched tier by tier (kvrag.stores) and
                                     checked (kvrag.core.acceptance)
    continuer                        grafts (kvrag.codecs, kvrag.core.prefill), text for the rest,
    (kvrag.engine.continuer)         the question, decoding (kvrag.core.decoding) and the receipt
    deposit (kvrag.core.deposit)     new states, verified by a canary before they are stored
    gate (kvrag.reuse.gate)          whether this model may blend (kvrag.reuse.blend: approximate)

The model is only ever called through `kvrag.core.runner.ModelRunner`.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence

from typing_extensions import Unpack

from kvrag.codecs import ReadyBuffers, StatePart
from kvrag.codecs.ready import DEFAULT_READY_BYTES
from kvrag.core.acceptance import Restored, StateAcceptance
from kvrag.core.continuation import Continuation
from kvrag.core.decoding import Generation, GenerationStream
from kvrag.core.deposit import CANARY_QUESTION, Depositor
from kvrag.core.prompt import DEFAULT_SYSTEM_PROMPT, LayoutKind, PromptLayout
from kvrag.core.protocol import AskOptions, BlendLimits, ChatOptions
from kvrag.core.restore import Restorer
from kvrag.core.runner import ModelRunner, logits_sha256
from kvrag.core.sampling import Sampling
from kvrag.core.schedule import Planner, Segment, StateRef
from kvrag.core.transcript import Message, Renderer, Transcript, messages_of
from kvrag.core.whereabouts import Whereabouts
from kvrag.engine.continuer import Continuer
from kvrag.errors import InputError, KVRagError, StateError, StoreError
from kvrag.kernels.attention import INVARIANT
from kvrag.models.loading import LoadedModel, load_model
from kvrag.reuse.blend import DEFAULT_RECOMPUTE_RATIO
from kvrag.reuse.gate import BlendGate
from kvrag.reuse.memo import Memo
from kvrag.reuse.prefixes import PrefixRecords
from kvrag.stores import StateStore, open_store
from kvrag.stores.deadline import DEFAULT_DEADLINE_S, Deadline
from kvrag.trust.identity import EngineIdentity
from kvrag.trust.records import SealedRecords
from kvrag.trust.signing import warn_if_unshared
from kvrag.trust.tenants import key_for

log = logging.getLogger("kvrag")

__all__ = ["KVEngine", "StateRef", "Segment", "Message", "Continuation", "Generation", "GenerationStream",
           "CANARY_QUESTION", "logits_sha256"]


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
        allow_unsigned: bool = False,
        namespace: str | None = None,
        deadline_s: float = DEFAULT_DEADLINE_S,
        blend_limits: BlendLimits | None = None,
        layout: LayoutKind | None = None,
        confidential: bool | None = None,
        stream_grafts: bool = False,
        ready_buffers_bytes: int = DEFAULT_READY_BYTES,
    ) -> None:
        """`signing_key`: see `kvrag.trust.signing` (default: `$KVRAG_SIGNING_KEY`, else this user's key),
        an operator's key or a tenant's (`kvrag.trust.tenants`); `allow_unsigned`: also graft unsigned
        states (a warning is logged once); `namespace`: the tenant (default: the store URL's
        `?namespace=`, else a tenant key's own), whose derived key signs and addresses everything
        this engine stores; `deadline_s`: the most one question
        waits on store reads before the text answers; `blend_limits`: the most an approximate blend
        may deviate from the exact path (`BlendLimits`: mean KL 0.1, agreement 0.8 unless set);
        `layout`: how documents and a question are laid out (`chat` for a model with a chat
        template, `completion` for a base model without one: the default follows the model);
        `confidential`: encrypt every state and record this engine writes under its tenant's key
        (default: whether the store URL says `?confidential=1`; see `kvrag.trust.confidential`);
        `stream_grafts`: a graft begins while its state is still arriving, each layer used once its
        chunks are checked (`kvrag.core.streaming`; off by default: on 2 cores the read and the
        forward share the CPU and it measured no faster); `ready_buffers_bytes`: under the invariant
        kernel, the most the whole-block K/V buffers of grafted states kept for the next question
        over the same stored bytes may hold (`kvrag.codecs.ready`; 0: none kept, every graft copies)."""
        self.model = model
        self.store = store if isinstance(store, StateStore) else open_store(store)
        #: the key this engine signs, seals and addresses with: the tenant's, for a namespace
        self.signing_key, self.namespace = key_for(signing_key, self.store.namespace if namespace is None else namespace)
        warn_if_unshared(signing_key, [tier.url for tier in self.store.tiers])
        self.allow_unsigned = allow_unsigned
        self.confidential = bool(self.store.confidential if confidential is None else confidential)
        if not 0 < deadline_s <= 3600:
            raise InputError("deadline_s must be more than 0 and at most 3600 seconds")
        self.deadline_s = deadline_s
        self.blend_limits = blend_limits or BlendLimits()
        #: who this engine is, computed once: every key and check uses this value
        self.identity = EngineIdentity.of(model.fingerprint, model.device, self.signing_key, self.namespace)
        self.layout = PromptLayout.for_tokenizer(model.tokenizer, system_prompt, layout)
        self.renderer = Renderer(model.tokenizer)
        self.runner = ModelRunner(model)
        self.planner = Planner(self.layout, self.identity, model.max_positions)
        acceptance = StateAcceptance(self.identity, self.runner.codecs, self.signing_key, model.vocabulary,
                                     allow_unsigned=allow_unsigned)
        self.restorer = Restorer(self.store, acceptance)
        self.records = SealedRecords(self.store, self.signing_key, allow_unsigned=allow_unsigned,  # type: ignore[arg-type]
                                     confidential=self.confidential)
        #: where each text's states are stored, to say why one did not graft (`kvrag explain`)
        self.whereabouts = Whereabouts(self.store, self.records, self.identity, self.signing_key)
        self.depositor = Depositor(self.runner, self.planner, self.store, self.identity, self.signing_key,
                                   self.whereabouts, confidential=self.confidential)
        #: under the invariant kernel, states serve any prompt that begins with their tokens
        self.prefixes = PrefixRecords(self.records, self.identity.scope) if model.attn == INVARIANT else None
        self.continuer = Continuer(self.runner, self.restorer, self.layout, self.identity, deadline_s, self.prefixes,
                                   self.whereabouts, stream_grafts=stream_grafts,
                                   ready=ReadyBuffers(ready_buffers_bytes) if model.attn == INVARIANT else None)
        self.memo = Memo(self)
        self.gate = BlendGate(self)

    @classmethod
    def open(cls, model: str | LoadedModel = "smollm2-135m", store: StateStore | str | None = None, *,
             dtype: str | None = None, attn: str | None = None, **kwargs: Any) -> "KVEngine":
        """An engine for a model name (loaded with `dtype` and `attn`) and a store URL: how the CLI
        and the framework adapters build one."""
        loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype=dtype, attn=attn)
        return cls(loaded, store, **kwargs)

    @property
    def fingerprint(self) -> str:
        """The model fingerprint's digest (what refs and retrieved documents carry)."""
        return self.identity.model_digest

    @property
    def tiers(self) -> list[StateStore]:
        return self.store.tiers

    # ------------------------------------------------------------------ refs
    def plan(self, texts: Sequence[str], *, after: StateRef | None = None) -> list[Segment]:
        """The segments (ids, keys, positions) for documents read in order, optionally after a chain."""
        return self.planner.documents(texts, after=after)

    def ref(self, text: str, *, after: StateRef | None = None) -> StateRef:
        """The ref a deposit of `text` would return, without computing or storing anything."""
        return self.planner.ref(self.plan([text], after=after)[0])

    def deposited(self, ref: StateRef) -> bool:
        """Whether some tier holds `ref` whole, manifest and every payload part (nothing is hashed)."""
        return self.restorer.has(ref.key, Deadline(self.deadline_s))

    def ensure(self, text: str, *, after: StateRef | None = None) -> StateRef:
        """The ref for `text`, deposited first if no tier has it yet (what retrievers call)."""
        ref = self.ref(text, after=after)
        return ref if self.deposited(ref) else self.deposit(text, after=after)

    def resolve(self, text: str, key: str) -> StateRef | str:
        """What a framework hands over (a document's text and the state key it was retrieved with)
        as `generate` input: this engine's root ref when the key is its own, else the plain text."""
        ref = self.ref(text)
        return ref if ref.key == key else text

    def check(self, segment: Segment, deadline: Deadline | None = None) -> None:
        """Raise the `StateError` that says why `segment`'s stored state cannot be grafted (if any)."""
        self.restorer.fetch(segment.key, segment, deadline or Deadline(self.deadline_s))

    def tokenize(self, text: str) -> list[int]:
        """`text`'s token ids, without special tokens."""
        return list(self.model.tokenizer(text, add_special_tokens=False)["input_ids"])

    def restore(self, ref: StateRef) -> StatePart:
        """Fetch and check one state; raises a `StateError` saying why it cannot be grafted."""
        self.planner.check_after(ref)
        segment = self.plan([ref.text])[0] if ref.parent_key is None else None
        return self.restorer.fetch(ref.key, segment).value.part

    # --------------------------------------------------------------- deposit
    def deposit(self, text: str, *, after: StateRef | None = None) -> StateRef:
        """Read `text` once, verify the state against a fresh computation, and store it.

        The state continues `after` (a chain) or starts at the prompt prefix. Idempotent: a state
        already stored under the same key is returned without recomputing. Raises `InputError`s
        for unusable text, `StateError`s for a foreign or missing parent, and `VerificationError`
        if the grafted state does not reproduce the fresh logits (nothing is stored then).
        """
        return self.deposit_chain([text], after=after)[0]

    def deposit_chain(self, texts: Sequence[str], *, after: StateRef | None = None) -> list[StateRef]:
        """Deposit documents as one chain, each state continuing the previous one.

        Each new state is computed after its ancestors' grafted states: one prefill per state."""
        segments = self.plan(texts, after=after)
        self._deposit_after(segments, self.restorer.chain(after.key if after else None, Deadline(self.deadline_s)))
        return [self.planner.ref(s) for s in segments]

    def deposit_segment(self, segment: Segment) -> StateRef:
        """Deposit a segment built with `planner.segment` (any ids, e.g. a memo state) after its
        stored parent chain."""
        self._deposit_after([segment], self.restorer.chain(segment.parent_key, Deadline(self.deadline_s)))
        return self.planner.ref(segment)

    def _deposit_after(self, segments: Sequence[Segment], chain: Sequence[Restored]) -> None:
        """Deposit `segments` in order after the stored `chain` (root first), each one skipped if
        stored already; with the invariant kernel, each new one is indexed by prefix."""
        ancestors: list[StatePart] = [r.part for r in chain]
        # the prompt's ids so far, kept only where prefix records need them
        before = [t for r in chain for t in r.manifest.token_ids] if self.prefixes is not None else []
        for segment in segments:
            try:
                ancestors.append(self.restorer.fetch(segment.key, segment, Deadline(self.deadline_s)).value.part)
            except StateError:
                restored: Restored = self.depositor.deposit(segment, ancestors)
                ancestors.append(restored.part)
                if self.prefixes is not None:
                    self.prefixes.record([*before, *segment.ids], segment.start, segment.key)
            if self.prefixes is not None:
                before.extend(segment.ids)

    # -------------------------------------------------------------- generate
    def generate(self, query: str, **options: Unpack[AskOptions]) -> Generation:
        """Answer `query` after the documents in `states`; see `stream` for the options."""
        return self.stream(query, **options).result()

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
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        blend: bool | float = False,
    ) -> GenerationStream:
        """Answer `query` after the documents in `states`, token by token; `.generation` holds the
        result after the last delta.

        `states` are refs from `deposit` (or plain document texts), in prompt order. A state is
        grafted only at its own position after its own chain; a ref placed elsewhere, or a state
        that is missing, damaged or foreign, is re-read as text and the receipt says why. With
        `graft=False` every document is re-read as text (the text-RAG arm of a comparison). With
        `approximate=True`, a ref placed elsewhere is moved there instead (keys re-rotated), and
        the receipt says `approximate-graft`, `exact=False`. With `deposit_missing`, the chain is
        deposited afterwards so the next identical ask grafts. With `memo` (the default), a
        recurring query with a verified memo entry for the same context is answered from it
        (receipt `memo`). With `blend` (True, or the share of tokens to recompute), a document
        whose chain state is missing but whose own state is stored is moved and partly recomputed
        (`approximate-graft`, see `kvrag.reuse.blend`), only if the gate passed this model and setting
        (`engine.gate.calibrate()`); otherwise the answer stays exact and the receipt says why. Decoding is greedy unless `temperature` > 0 (then `top_k`, `top_p` and
        `seed` apply; the same seed gives the same tokens; see `kvrag.core.sampling`). Input errors are
        raised here, before the first step.
        """
        sampling = _sampling(max_new_tokens, temperature, top_p, top_k, seed)
        requested = list(states or [])
        texts = [r.text if isinstance(r, StateRef) else r for r in requested]
        segments = self.plan(texts)
        question = self.planner.question(query, segments)
        self.planner.check_length((segments[-1].end if segments else 0) + len(question))
        deadline = Deadline(self.deadline_s)  # one for every store read of this question
        ratio, notes = None, []
        if blend and graft:
            ratio = DEFAULT_RECOMPUTE_RATIO if blend is True else float(blend)
            refusal = self.gate.refusal(ratio, deadline=deadline)
            if refusal:
                ratio, notes = None, [refusal]
            else:  # each document's own state, wherever its chain state is missing
                requested = [r if isinstance(r, StateRef) else self._own_ref(r) for r in requested]
        if memo and graft and not approximate and ratio is None and not stop and sampling.greedy:
            recall = self.memo.recall(query, segments, max_new_tokens, deadline)
            if recall is not None:
                return self.run(recall)
        stream = self.run(Continuation(segments, question, max_new_tokens, stop or self.layout.answer_stops, graft,
                                       requested, approximate, deadline=deadline, sampling=sampling, blend=ratio,
                                       notes=notes, any_boundary=not approximate and ratio is None,
                                       layout=self.layout.kind))
        if deposit_missing and texts:
            return GenerationStream(self._then_deposit(stream, texts))
        return stream

    def chat(self, messages: Sequence[Message | dict[str, Any]], **options: Unpack[ChatOptions]) -> Generation:
        """Answer a conversation; see `stream_chat`."""
        return self.stream_chat(messages, **options).result()

    def stream_chat(
        self,
        messages: Sequence[Message | dict[str, Any]],
        *,
        max_new_tokens: int = 64,
        stop: Sequence[str] | None = None,
        graft: bool = True,
        deposit_missing: bool = False,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
    ) -> GenerationStream:
        """Answer a conversation as a framework formats it (OpenAI-style `{"role", "content"}`
        messages; a completion prompt is one user message), token by token.

        The messages are rendered with the model's chat template and cut where their content says
        so (see `kvrag.core.transcript`): every segment a stored state covers is grafted, the rest is
        read as text in the same segments, so the answer is the same either way. With
        `deposit_missing`, the segments read as text are deposited afterwards, and in a
        conversation (one that already holds an assistant turn) so are the last message and this
        answer, so that the next turn grafts everything before its new message. The other
        options are `stream`'s.
        """
        sampling = _sampling(max_new_tokens, temperature, top_p, top_k, seed)
        checked = messages_of(messages)
        for message in checked:
            self.planner.check_size(message.content)
        transcript = self.renderer.render(checked)
        return self._run_transcript(transcript, self._chat_layout, max_new_tokens, stop or self.renderer.chat_stops,
                                    graft, sampling, deposit_missing, checked)

    @property
    def _chat_layout(self) -> str:
        return "chat-template" if self.renderer.chat_form == "template" else "plain-chat"

    def complete(self, prompt: str, **options: Unpack[ChatOptions]) -> Generation:
        """Continue a completion prompt; see `stream_complete`."""
        return self.stream_complete(prompt, **options).result()

    def stream_complete(
        self,
        prompt: str,
        *,
        max_new_tokens: int = 64,
        stop: Sequence[str] | None = None,
        graft: bool = True,
        deposit_missing: bool = False,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
    ) -> GenerationStream:
        """Continue a completion prompt (a framework's formatted prompt string, OpenAI's
        `/v1/completions`), token by token. A base model (the `completion` layout) reads it as
        given, after its begin-of-text token, exactly as a stock `model.generate` on
        `tokenizer(prompt)` would (receipt layout `prompt`); a chat model reads it as one user
        message (`stream_chat`). Cut, grafted and deposited as `stream_chat` does."""
        if self.layout.kind == "chat":
            return self.stream_chat([Message(role="user", content=prompt)], max_new_tokens=max_new_tokens, stop=stop,
                                    graft=graft, deposit_missing=deposit_missing, temperature=temperature,
                                    top_p=top_p, top_k=top_k, seed=seed)
        sampling = _sampling(max_new_tokens, temperature, top_p, top_k, seed)
        transcript = self.renderer.render_prompt(self.planner.check_size(prompt))
        return self._run_transcript(transcript, "prompt", max_new_tokens, stop or (), graft, sampling,
                                    deposit_missing, None)

    def _run_transcript(self, transcript: Transcript, layout: str, max_new_tokens: int, stop: Sequence[str],
                        graft: bool, sampling: Sampling, deposit_missing: bool,
                        messages: list[Message] | None) -> GenerationStream:
        self.planner.check_length(len(transcript.ids))
        *context, feed = self.planner.chain(transcript.pieces(), layout)
        stream = self.run(Continuation(context, feed.ids, max_new_tokens, stop, graft, deadline=Deadline(self.deadline_s),
                                       sampling=sampling, any_boundary=True, layout=layout))
        if deposit_missing:
            if messages is None:
                return GenerationStream(self._then_deposit_segments(stream, context))
            return GenerationStream(self._then_deposit_turn(stream, messages, context))
        return stream

    def deposit_chat(self, messages: Sequence[Message | dict[str, Any]]) -> list[StateRef]:
        """Deposit a conversation's segments ahead of time (all of them: the next message starts a
        new segment), so the first ask that continues it grafts them."""
        transcript = self.renderer.render(messages_of(messages), generation_prompt=False)
        self.planner.check_length(len(transcript.ids))
        segments = self.planner.chain(transcript.pieces(), self._chat_layout)
        self._deposit_segments(segments)
        return [self.planner.ref(s) for s in segments]

    def _deposit_segments(self, segments: Sequence[Segment]) -> None:
        self._deposit_after(segments, [])

    def _then_deposit_turn(self, stream: GenerationStream, messages: list[Message],
                           context: list[Segment]) -> Iterator[str]:
        yield from stream
        generation = stream.result()
        try:
            segments = context
            if any(m.role == "assistant" for m in messages) and generation.text:
                answered = [*messages, Message(role="assistant", content=generation.text)]
                following = self.planner.chain(self.renderer.render(answered, generation_prompt=False).pieces(),
                                               self._chat_layout)
                if [s.key for s in following[: len(context)]] == [s.key for s in context]:
                    segments = following
            if segments is not context or any(u.source != "graft" for u in generation.receipt.states):
                self._deposit_segments(segments)
        except KVRagError as e:  # the answer stands; the next ask re-reads the text
            log.warning("answered, but could not deposit the conversation afterwards: %s", e)
        return generation

    def _then_deposit_segments(self, stream: GenerationStream, context: list[Segment]) -> Iterator[str]:
        yield from stream
        generation = stream.result()
        if any(u.source != "graft" for u in generation.receipt.states):
            try:
                self._deposit_segments(context)
            except KVRagError as e:  # the answer stands; the next ask re-reads the text
                log.warning("answered, but could not deposit the prompt afterwards: %s", e)
        return generation

    def _own_ref(self, text: str) -> StateRef | str:
        ref = self.ref(text)
        return ref if self.deposited(ref) else text

    def run(self, continuation: Continuation) -> GenerationStream:
        """Run a continuation: its context grafted where stored, its ids fed, decoding up to N tokens."""
        return self.continuer.stream(continuation)

    def _then_deposit(self, stream: GenerationStream, texts: list[str]) -> Iterator[str]:
        yield from stream
        generation = stream.result()
        if any(u.source != "graft" for u in generation.receipt.states):
            try:
                self.deposit_chain(texts)
            except (StoreError, StateError) as e:  # the answer stands; the next ask re-reads the text
                log.warning("answered, but could not deposit the chain afterwards: %s", e)
        return generation


def _sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None) -> Sampling:
    if max_new_tokens < 1:
        raise InputError("max_new_tokens must be at least 1")
    try:
        return Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    except ValueError as e:
        raise InputError(f"bad sampling settings: {' '.join(str(e).split())[:300]}") from e
