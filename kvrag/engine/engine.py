"""The engine: a facade that wires the parts a question passes through, each given only what it uses.

A question's path through `KVEngine.stream`, top-down:

    plan      the documents' segments and the question's ids (kvrag.core.schedule; a formatted
              prompt is cut by its content, kvrag.core.transcript), one deadline for the reads
    recall    a recurring question with a verified memo entry is answered from it (kvrag.reuse.memo)
    restore   each segment's state, tier by tier, checked (kvrag.core.restore, kvrag.core.acceptance)
    forward   grafts, then what was not stored and the question as text, in one schedule
              (kvrag.engine.continuer, kvrag.core.prefill)
    decode    greedy or sampled tokens, cut at the stops, and the receipt (kvrag.core.decoding)
    deposit   afterwards, with `deposit_missing`: what was read as text (kvrag.core.deposit)

The model is only ever called through `kvrag.core.runner.ModelRunner`.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence

from typing_extensions import Unpack

from kvrag.codecs import StatePart
from kvrag.codecs.ready import DEFAULT_READY_BYTES
from kvrag.core.acceptance import StateAcceptance
from kvrag.core.continuation import Continuation, plan_segments
from kvrag.core.decoding import Generation, GenerationStream
from kvrag.core.deposit import CANARY_QUESTION, Answered, Depositor
from kvrag.core.options import GenerationOptions, GenerationSettings, options_of
from kvrag.core.prefixes import PrefixRecords
from kvrag.core.prompt import DEFAULT_SYSTEM_PROMPT, LayoutKind, PromptLayout
from kvrag.core.protocol import BlendLimits
from kvrag.core.restore import Restorer
from kvrag.core.runner import logits_sha256
from kvrag.core.schedule import Planner, Segment, StateRef
from kvrag.core.transcript import Message, Renderer
from kvrag.core.whereabouts import Whereabouts
from kvrag.engine.continuer import Continuer
from kvrag.engine.gate import EngineGate
from kvrag.engine.memo import EngineMemo
from kvrag.engine.runtime import Runtime
from kvrag.engine.transcripts import Transcripts, read_as_text
from kvrag.errors import InputError, KVRagError
from kvrag.kernels.attention import INVARIANT
from kvrag.models.loading import LoadedModel, load_model
from kvrag.reuse.admission import Admission
from kvrag.reuse.blend import DEFAULT_RECOMPUTE_RATIO
from kvrag.reuse.levers import reorder
from kvrag.stores import StateStore, open_store
from kvrag.stores.deadline import DEFAULT_DEADLINE_S, Deadline
from kvrag.stores.outages import log_failure
from kvrag.trust.identity import EngineIdentity
from kvrag.trust.records import SealedRecords
from kvrag.trust.signing import warn_if_unshared
from kvrag.trust.tenants import key_for

log = logging.getLogger("kvrag")
deposits_log = logging.getLogger("kvrag.deposits")

__all__ = ["KVEngine", "StateRef", "Segment", "Message", "Continuation", "Generation", "GenerationStream",
           "GenerationOptions", "CANARY_QUESTION", "logits_sha256"]


class KVEngine(Transcripts):
    """Deposit documents as verified KV states; generate with them grafted.

        >>> engine = KVEngine(load_model("tiny-random-llama"), "memory://")
        >>> ref = engine.deposit("Paris is the capital of France.")
        >>> engine.generate("What is the capital of France?", states=[ref]).receipt.mode
        'exact-graft'

    - `store`: a `StateStore` or a store URL (default: the embedded disk store).
    - `signing_key`: see `kvrag.trust.signing` (default: `$KVRAG_SIGNING_KEY`, else this user's
      key), an operator's key or a tenant's (`kvrag.trust.tenants`); `allow_unsigned`: also graft
      unsigned states (a warning is logged once).
    - `namespace`: the tenant (default: the store URL's `?namespace=`, else a tenant key's own),
      whose derived key signs and addresses everything this engine stores.
    - `deadline_s`: the most one question waits on store reads before the text answers.
    - `blend_limits`: the most an approximate blend may deviate from the exact path (`BlendLimits`).
    - `layout`: how documents and a question are laid out (`chat` for a model with a chat
      template, `completion` for a base model without one; the default follows the model).
    - `confidential`: encrypt every state and record this engine writes under its tenant's key
      (default: whether the store URL says `?confidential=1`; see `kvrag.trust.confidential`).
    - `stream_grafts`: a graft begins while its state is still arriving, each layer used once its
      chunks are checked (`kvrag.core.streaming`; off by default: the read and the forward share
      the cores, so it pays only where the read waits on the network).
    - `ready_buffers_bytes`: under the invariant kernel, the most the whole-block K/V buffers of
      grafted states kept for the next question over the same stored bytes may hold
      (`kvrag.codecs.ready`; 0: none kept, every graft copies); with a `Runtime`, its pool's.

    `model` is a `LoadedModel`, or a `Runtime` to share with other engines (a server's tenants:
    one runner, buffer pool, deposit worker and batch). `close()`, or a `with` block, ends what
    the engine opened.
    """

    def __init__(
        self,
        model: LoadedModel | Runtime,
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
        if not 0 < deadline_s <= 3600:
            raise InputError("deadline_s must be more than 0 and at most 3600 seconds")
        #: the model and what runs it; an engine made from a `LoadedModel` has a runtime of its own
        self.runtime = model if isinstance(model, Runtime) else Runtime(model, ready_buffers_bytes=ready_buffers_bytes)
        self._owns_runtime = not isinstance(model, Runtime)
        model = self.runtime.model
        self.model, self.deadline_s, self.allow_unsigned = model, deadline_s, allow_unsigned
        self._owns_store = not isinstance(store, StateStore)
        self.store = store if isinstance(store, StateStore) else open_store(store)
        #: the key this engine signs, seals and addresses with: the tenant's, for a namespace
        self.signing_key, self.namespace = key_for(signing_key, self.store.namespace if namespace is None else namespace)
        warn_if_unshared(signing_key, [tier.url for tier in self.store.tiers])
        self.confidential = bool(self.store.confidential if confidential is None else confidential)
        self.blend_limits = blend_limits or BlendLimits()
        #: who this engine is, computed once: every key and check uses this value
        self.identity = EngineIdentity.of(model.fingerprint, model.device, self.signing_key, self.namespace)
        self.layout = PromptLayout.for_tokenizer(model.tokenizer, system_prompt, layout)
        self.renderer = Renderer(model.tokenizer)
        self.runner = self.runtime.runner
        self.planner = Planner(self.layout, self.identity, model.max_positions)
        #: what this engine was made with, for its tenants' engines (`tenant`)
        self._settings: dict[str, Any] = dict(system_prompt=system_prompt, signing_key=signing_key,
                                              allow_unsigned=allow_unsigned, deadline_s=deadline_s,
                                              blend_limits=blend_limits, layout=layout, confidential=confidential,
                                              stream_grafts=stream_grafts)
        self._wire(stream_grafts)

    def tenant(self, namespace: str) -> "KVEngine":
        """An engine for the tenant `namespace`: the same runtime and store, every setting of this
        one, and the tenant's namespace and key (derived from this engine's signing key)."""
        return KVEngine(self.runtime, self.store, namespace=namespace, **self._settings)

    def with_store(self, store: StateStore | str | None) -> "KVEngine":
        """An engine over `store` with this one's runtime, namespace and every setting (an A/B run
        on a fresh store, say)."""
        return KVEngine(self.runtime, store, namespace=self.namespace, **self._settings)

    def _wire(self, stream_grafts: bool) -> None:
        """The parts a question passes through, each given only what it uses."""
        invariant = self.model.attn == INVARIANT
        acceptance = StateAcceptance(self.identity, self.runner.codecs, self.signing_key, self.model.vocabulary,
                                     allow_unsigned=self.allow_unsigned)
        self.restorer = Restorer(self.store, acceptance)
        self.records = SealedRecords(self.store, self.signing_key, allow_unsigned=self.allow_unsigned,
                                     confidential=self.confidential)
        #: where each text's states are stored, to say why one did not graft (`kvrag explain`)
        self.whereabouts = Whereabouts(self.store, self.records, self.identity, self.signing_key)
        #: under the invariant kernel, states serve any prompt that begins with their tokens
        self.prefixes = PrefixRecords(self.records, self.identity.scope) if invariant else None
        self.depositor = Depositor(self.runner, self.planner, self.store, self.restorer, self.identity,
                                   self.signing_key, deadline_s=self.deadline_s, whereabouts=self.whereabouts,
                                   prefixes=self.prefixes, confidential=self.confidential,
                                   batching=self.runtime.batching)
        #: deposits after answers, off their path (`deposit_in_background`): the runtime's one worker
        self.deposits = self.runtime.deposits
        self.continuer = Continuer(self.runner, self.restorer, self.layout, self.identity, self.deadline_s,
                                   self.prefixes, self.whereabouts, stream_grafts=stream_grafts,
                                   ready=self.runtime.ready, deposits=self.deposits, batching=self.runtime.batching)
        self.admission = Admission()  # which chains read as text are deposited (`admit_after`)
        self.memo = EngineMemo(self.identity, self.planner, self.records, self.depositor, self.restorer, self.run,
                         vocabulary=self.model.vocabulary, deadline_s=self.deadline_s)
        self.gate = EngineGate(self.identity, self.planner, self.records, self.depositor, self.run,
                              limits=self.blend_limits, deadline_s=self.deadline_s)

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

    def holds(self, ref: StateRef) -> bool:
        """Whether some tier holds `ref` whole, manifest and every payload part (nothing is hashed)."""
        return self.restorer.holds(ref.key, Deadline(self.deadline_s))

    def ensure(self, text: str, *, after: StateRef | None = None) -> StateRef:
        """The ref for `text`, deposited first if no tier has it yet (what retrievers call)."""
        ref = self.ref(text, after=after)
        return ref if self.holds(ref) else self.deposit(text, after=after)

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
        return self.layout.tokenize(text)

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
        self.depositor.extend(segments)
        return [self.planner.ref(s) for s in segments]

    def deposit_many(self, texts: Iterable[str]) -> list[StateRef]:
        """Deposit each text as its own state (not a chain), skipping those some tier holds
        already, so a repeated call resumes; `kvrag.apps.ingest` does it for a corpus, with a summary."""
        segments = [self.plan([text])[0] for text in texts]
        for segment in segments:
            self.depositor.ensure(segment)
        return [self.planner.ref(s) for s in segments]

    # -------------------------------------------------------------- generate
    def generate(self, query: str, *, states: Sequence[StateRef | str] | None = None,
                 options: GenerationOptions | None = None, **settings: Unpack[GenerationSettings]) -> Generation:
        """Answer `query` after the documents in `states`; see `stream`."""
        return self.stream(query, states=states, options=options, **settings).result()

    def stream(self, query: str, *, states: Sequence[StateRef | str] | None = None,
               options: GenerationOptions | None = None, **settings: Unpack[GenerationSettings]) -> GenerationStream:
        """Answer `query` after the documents in `states`, token by token; `.generation` holds the
        result after the last delta.

        `states` are refs from `deposit` (or plain document texts), in prompt order. A state is
        grafted only at its own position after its own chain; a ref placed elsewhere, or a state
        that is missing, damaged or foreign, is re-read as text and the receipt says why. How to
        answer is `options` (a `GenerationOptions`), each keyword setting overriding it: with
        `graft=False` every document is re-read as text; with `approximate=True` a ref placed
        elsewhere is moved there instead (`approximate-graft`, `exact=False`); with `blend` a
        document whose chain state is missing but whose own state is stored is moved and partly
        recomputed, only if the gate passed this model and setting (`engine.gate.calibrate()`);
        with `memo` (the default) a recurring query with a verified memo entry for the same
        context is answered from it (receipt `memo`); with `deposit_missing` the chain is
        deposited afterwards. Input errors are raised here, before the first step.
        """
        opts = options_of(options, dict(settings))
        requested = reorder(self, states or [], opts.order)
        texts = [r.text if isinstance(r, StateRef) else r for r in requested]
        segments = self.plan(texts)
        question = self.planner.question(query, segments)
        self.planner.check_length((segments[-1].end if segments else 0) + len(question))
        deadline = Deadline(self.deadline_s)  # one for every store read of this question
        ratio, notes, requested = self._blend(opts, requested, deadline)
        exact = not opts.approximate and ratio is None
        if opts.memo and opts.graft and exact and not opts.stop and opts.sampling.greedy:  # what a memo entry recorded
            recall = self.memo.recall(query, segments, opts.max_new_tokens, deadline)
            if recall is not None:
                return self.run(recall)
        steps = plan_segments(segments, requested, scope=self.identity.scope_id, graft=opts.graft,
                     approximate=opts.approximate, blend=ratio, prefix=exact)
        answer = self.run(Continuation(steps, question, opts.max_new_tokens, opts.stops(self.layout.answer_stops),
                                       deadline=deadline, sampling=opts.sampling, notes=notes, layout=self.layout.kind))
        if opts.deposits and segments:
            return self._then_deposit(answer, lambda generation: segments if read_as_text(generation) and
                                      self.admission.admit(segments, opts.admit_after) else [], "the chain", opts,
                                      segments, question)
        return answer

    def _blend(self, opts: GenerationOptions, requested: list[StateRef | str],
               deadline: Deadline) -> tuple[float | None, list[str], list[StateRef | str]]:
        """The share of tokens to recompute in a blend (None: no blend), why a blend asked for was
        refused, and what to graft: where blending, each document's own state if stored."""
        if not opts.blend or not opts.graft:
            return None, [], requested
        ratio = DEFAULT_RECOMPUTE_RATIO if opts.blend is True else float(opts.blend)
        refusal = self.gate.refusal(ratio, deadline=deadline)
        if refusal:
            return None, [refusal], requested
        return ratio, [], [r if isinstance(r, StateRef) else self._own_ref(r) for r in requested]

    def _own_ref(self, text: str) -> StateRef | str:
        ref = self.ref(text)
        return ref if self.holds(ref) else text

    def _then_deposit(self, answer: GenerationStream, segments: Callable[[Generation], Sequence[Segment]],
                      what: str, opts: GenerationOptions, context: Sequence[Segment], feed: Sequence[int]) -> GenerationStream:
        """`answer`, then the `segments(generation)` it names deposited: after its last delta, or
        with `deposit_in_background`, on the worker of `self.deposits` (off the answer's path). A
        chain that is the answer's own `context` is stored only if it reproduces the answer, read
        after it from `feed` (`kvrag.core.deposit.Answered`). The answer stands whatever the
        deposit meets; the next ask then re-reads the text."""
        queue = self.deposits if opts.deposit_in_background else None
        keys = [s.key for s in context]

        def steps() -> Iterator[str]:
            yield from answer
            generation = answer.result()
            try:
                chain = segments(generation)
                own = generation.receipt.exact and [s.key for s in chain] == keys
                answered = Answered(tuple(feed), generation.receipt.first_token_logits_sha256) if own else None
                if queue is None:
                    self.depositor.extend(chain, answered)
                else:
                    grafted = {use.key for use in generation.receipt.states if use.source == "graft"}
                    queue.submit(chain, what, missing={s.key for s in chain if s.key not in grafted},
                                 deposit=partial(self.depositor.extend, answered=answered))
            except KVRagError as e:
                log_failure(deposits_log, "answered, but could not deposit %s afterwards: %s", what, e, error=e)
            return generation

        return GenerationStream(steps())

    def run(self, continuation: Continuation) -> GenerationStream:
        """Run a continuation: its context grafted where stored, its ids fed, decoding up to N tokens."""
        return self.continuer.stream(continuation)

    # ------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close the store; an engine with a runtime of its own closes that too (its queued
        deposits run first). A runtime or store it was given is left to whoever gave it."""
        if self._owns_runtime:
            self.runtime.close()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> "KVEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

