"""Running a continuation: run a schedule (grafting every state that passes its checks), feed some ids,
decode up to N tokens. Every answer kvrag gives goes through here: `KVEngine.generate`, a memo
recall, the A/B harness's arms. This is the only decode loop.

A context segment whose state cannot be grafted is re-read as text in the same segment, so the
bytes stay those of a fresh computation of the same schedule; the receipt names each segment's
source and, for a fallback, the reason.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from kvrag.codecs import ReadyBuffers, StatePart, truncated
from kvrag.core.acceptance import Restored
from kvrag.core.batching import Batching
from kvrag.core.continuation import Blend, Continuation, Graft, Move, Prefix, Recall, Text
from kvrag.core.decoding import Generation, GenerationStream, TextDecoder
from kvrag.core.prefill import Graftable, Prefill
from kvrag.core.prefixes import PrefixRecords, common_prefix
from kvrag.core.prompt import PromptLayout
from kvrag.core.receipt import Receipt, StateUse, Timings, mode_of
from kvrag.core.restore import Restorer
from kvrag.core.runner import DecodeStep, ModelRunner, logits_sha256
from kvrag.core.schedule import Segment
from kvrag.core.whereabouts import Whereabouts
from kvrag.errors import ModelError, StateError, StreamFailedError
from kvrag.reuse.approximate import moved_graft
from kvrag.reuse.blend import blend_into
from kvrag.reuse.deposit_queue import DepositQueue
from kvrag.stores import Found
from kvrag.stores.deadline import Deadline
from kvrag.trust.identity import EngineIdentity

if TYPE_CHECKING:
    from kvrag.core.batching import Batcher, Lane

__all__ = ["Continuer"]


class Continuer:
    """Runs continuations for one model, store and layout."""

    def __init__(self, runner: ModelRunner, restorer: Restorer, layout: PromptLayout, identity: EngineIdentity,
                 deadline_s: float, prefixes: PrefixRecords | None = None,
                 whereabouts: Whereabouts | None = None, *, stream_grafts: bool = False,
                 ready: ReadyBuffers | None = None, deposits: DepositQueue | None = None,
                 batching: Batching | None = None) -> None:
        self.runner = runner
        #: deposits under way: a context being deposited is waited for, not read again beside it
        self.deposits = deposits
        #: whole-block buffers of grafted states, kept for the next question over the same bytes
        self.ready = ready
        #: grafts begin before their states have arrived (`kvrag.core.streaming`)
        self.stream_grafts = stream_grafts
        self.whereabouts = whereabouts
        self.prefixes = prefixes
        self.identity = identity
        self.restorer = restorer
        self.layout = layout
        self.deadline_s = deadline_s
        #: the model's batch, where it has one: reads and steps packed with other generations'
        self.batching = batching or Batching()

    def stream(self, continuation: Continuation) -> GenerationStream:
        return GenerationStream(self._steps(continuation))

    def _context(self, run: Prefill, c: Continuation, deadline: Deadline, *, stream: bool,
                 read: dict[str, Found[Restored]] | None = None) -> list[StateUse]:
        """Run the plan's context steps; `read`: states a failed stream's read went on to find whole
        in a later tier (checked there), grafted as they are."""
        uses: list[StateUse] = []
        read = read or {}
        covered = 0
        for step in c.plan:
            if isinstance(step, Prefix):
                if self.prefixes is not None and c.context:
                    own = self._own_stored_run(c.context, deadline)
                    if own < c.context[-1].end:  # the context's own states do not cover it: look further
                        covered, uses = self._stored_prefix(run, c.context, deadline, better_than=own)
                continue
            segment = step.segment
            if segment.end <= covered:
                continue
            if segment.start < covered:
                run.text(segment.ids[covered - segment.start :])
                uses.append(StateUse(key=segment.key, start=covered, end=segment.end, source="text", reason="missing",
                                     detail=f"read as text from {covered}, where the longest stored prefix ends"))
                continue
            uses.append(self._segment(run, step, deadline, stream=stream, found=read.get(segment.key)))
        return uses

    def _segment(self, run: Prefill, step: Graft | Move | Blend | Recall | Text, deadline: Deadline, *,
                 stream: bool, found: Found[Restored] | None) -> StateUse:
        """One context step: the segment's own state grafted (or `found`), else, for a move or a
        blend, the other ref's state moved here, else its text; and what the receipt says of it."""
        segment = step.segment
        other = step.ref if isinstance(step, (Move, Blend)) else None if isinstance(step, Recall) else step.requested
        span: dict[str, Any] = {"key": segment.key, "start": segment.start, "end": segment.end,
                                "requested_key": other.key if other is not None else None}
        if isinstance(step, Text):
            run.text(segment.ids)
            return StateUse(**span, source="text", reason=step.reason, detail=step.detail)
        try:
            with run.restoring():
                fetched = (Graftable(found.value.part, found.tier, found.notes) if found is not None
                           else self.restorer.graftable(segment, deadline, stream=stream))
            grafted = run.graft(fetched)
            return StateUse(**span, source="graft", tier=grafted.tier, detail=grafted.notes)
        except StateError as e:
            if isinstance(step, Recall):
                raise
            reason, detail = e.reason, str(e)
        # A ref made in another scope (signing key, namespace, hardware) is `foreign`; one of this
        # scope with another key was deposited at another position or after another chain: `moved`.
        if other is not None and other.foreign_to(self.identity.scope_id):
            reason, detail = "foreign", (
                f"state {other.key[:12]} was deposited in another scope (another signing key, namespace or "
                f"hardware) than this engine's; this engine's own state for the text: {detail}"
            )
        elif other is not None:
            reason, detail = "moved", (
                f"state {other.key[:12]} was deposited at positions {other.start}..{other.end} after "
                f"{'the prompt prefix' if other.parent_key is None else 'state ' + other.parent_key[:12]}; it is needed "
                f"at {segment.start}..{segment.end}. {detail}"
            )
            if isinstance(step, (Move, Blend)):
                try:
                    return self._moved(run, step, deadline, span, detail)
                except StateError as e:
                    detail += f" Not moved either: {e}"
        if reason == "missing" and self.whereabouts is not None:  # say what is stored for it under other settings
            elsewhere = self.whereabouts.describe(segment, deadline)
            detail = f"{detail} {elsewhere}" if elsewhere else detail
        run.text(segment.ids)
        return StateUse(**span, source="text", reason=reason, detail=detail)

    def _moved(self, run: Prefill, step: Move | Blend, deadline: Deadline, span: dict[str, Any], detail: str) -> StateUse:
        """`step.ref`'s state, deposited elsewhere, moved to the step's positions (and blended, for
        a `Blend`): an approximate graft the receipt labels as one."""
        segment = step.segment
        doc_ids = self.layout.document_ids(segment.text)

        with run.restoring():
            moved = moved_graft(self.runner.model.hf_model, self.runner.codecs,
                                self.restorer.fetch(step.ref.key, None, deadline), doc_ids, segment,
                                rerotate=step.rerotate)
        if isinstance(step, Blend):
            grafted, count = blend_into(run, moved, doc_ids, step.ratio)
            detail += f" Moved and blended: {count} of {len(doc_ids)} tokens recomputed."
        else:
            grafted = run.graft(moved)
        return StateUse(**span, source="approximate", tier=grafted.tier, reason="moved", detail=detail)

    def _own_stored_run(self, context: Sequence[Segment], deadline: Deadline) -> int:
        """Where the run of the context's own stored states from the start ends (cheap: no hashing)."""
        end = 0
        for segment in context:
            if not self.restorer.holds(segment.key, deadline):
                break
            end = segment.end
        return end

    def _stored_prefix(self, run: Prefill, context: Sequence[Segment], deadline: Deadline, *,
                       better_than: int) -> tuple[int, list[StateUse]]:
        """Graft the longest stored chain the context begins with, cut where its tokens and the
        context's part, if it covers more than `better_than` positions; (positions covered, their uses)."""
        assert self.prefixes is not None
        began = time.perf_counter()
        ids = [t for segment in context for t in segment.ids]
        hint = self.prefixes.longest(ids, deadline)
        chain: list[Found[Restored]] = []
        # a record may point past its mark (at a deeper state of the chain): worth a look unless it
        # is one of the context's own states, which the run ending at `better_than` already covers
        own = {segment.key for segment in context}
        key = hint.key if hint and (hint.position > better_than or hint.key not in own) else None
        try:
            while key is not None and len(chain) < len(ids):
                chain.append(self.restorer.fetch(key, None, deadline))
                key = chain[-1].value.manifest.parent_key
        except StateError:
            chain = []
        plan: list[tuple[Found[Restored], StatePart, int]] = []
        covered = 0
        for found in reversed(chain):
            manifest = found.value.manifest
            shared = common_prefix(manifest.token_ids, ids[covered:]) if manifest.start == covered else 0
            try:
                part = truncated(self.runner.codecs, found.value.part, covered + shared) if shared else None
            except ModelError:
                part = None
            if part is None:
                break
            plan.append((found, part, shared))
            covered += shared
            if part.end < manifest.end:
                break
        run.restore_s += time.perf_counter() - began
        if covered <= better_than:  # the context's own states do at least as well
            return 0, []
        uses = []
        for found, part, shared in plan:
            manifest = found.value.manifest
            run.graft(Graftable(part, found.tier, found.notes))
            cut = f"its first {shared} of {manifest.token_count} tokens: the longest stored prefix"
            uses.append(StateUse(key=manifest.key, start=part.start, end=part.end, source="graft", tier=found.tier,
                                 detail=cut if shared < manifest.token_count else found.notes))
        return covered, uses

    def _await_deposit(self, c: Continuation) -> list[str]:
        """Wait while this context is being deposited (at most the queue's `max_wait_s`) rather
        than read its text beside the deposit; what to say of it."""
        grafts = c.grafts
        if self.deposits is None or not grafts:
            return []
        waited = self.deposits.wait_for([s.key for s in grafts], self.deposits.max_wait_s)
        return [f"waited {waited * 1e3:.0f} ms for this context's deposit, under way"] if waited else []

    def _steps(self, c: Continuation) -> Iterator[str]:
        began = time.perf_counter()
        deadline = c.deadline or Deadline(self.deadline_s)  # one for every store read of this question
        said = [*c.notes, *self._await_deposit(c)]
        # a memo answer never enters the batch: its few steps run alone
        batcher = self.batching.batcher if not c.memo else None
        run: Prefill | None = None
        try:
            with batcher.lane() if batcher is not None else nullcontext() as lane:
                run, uses, logits = self._batched_prompt(c, deadline, batcher, lane)
                first_logits = logits.clone()
                limit = min(c.max_new_tokens, self.runner.model.max_positions - c.prompt_tokens)
                sampler = self.runner.sampler(c.sampling)
                tokens = [sampler.pick(logits)] if limit > 0 else []
                ttft_s = time.perf_counter() - began
                t = time.perf_counter()
                text = TextDecoder(self.runner.model.tokenizer, self.layout.stop_ids, c.stop, c.known)
                for token in tokens:
                    yield from text.push(token)
                while not text.done and len(tokens) < limit:
                    step = DecodeStep(tokens[-1], c.prompt_tokens + len(tokens) - 1, run.cache)
                    logits = lane.step(step) if lane is not None else self.runner.step(step.token, step.cache)
                    tokens.append(sampler.pick(logits))
                    yield from text.push(tokens[-1])
            yield from text.flush()
        finally:  # the kept buffers go back now, whether the answer ended, failed or was abandoned
            if run is not None:
                run.cache.release()
        decode_s = time.perf_counter() - t
        return self._generation(c, run, uses, said, sampler, tokens, text, first_logits,
                                ttft_s=ttft_s, decode_s=decode_s, began=began)

    def _batched_prompt(self, c: Continuation, deadline: Deadline, batcher: Batcher | None,
                        lane: Lane | None) -> tuple[Prefill, list[StateUse], Any]:
        """`_prompt`, its reads in the batch's forwards where there is one; a blend, which runs the
        model otherwise too, holds the model between two of them."""
        if lane is None or batcher is None:
            return self._prompt(c, deadline)
        if c.blend is None:
            return self._prompt(c, deadline, lane.read)
        with batcher.turn():
            return self._prompt(c, deadline)

    def _prompt(self, c: Continuation, deadline: Deadline, forward: Any = None) -> tuple[Prefill, list[StateUse], Any]:
        """The context grafted or read, then the feed read: the prefill, its uses and the last logits."""
        run = Prefill(self.runner, self.ready, forward)
        try:
            try:
                uses = self._context(run, c, deadline, stream=self.stream_grafts)
                logits = run.text(c.feed)
                notes = run.end_streams(deadline)
                uses = [u.model_copy(update={"detail": notes[u.key]}) if u.source == "graft" and u.key in notes
                        else u for u in uses]
            except StreamFailedError:
                # a streamed state failed after its graft began: its cache is dropped and the whole
                # context read again, nothing streamed (what a later tier served whole is grafted as it
                # came; otherwise the next tier or the text answers for it)
                found = run.drop_streams(deadline)
                run.cache.release()
                run = Prefill(self.runner, self.ready, forward)
                uses = self._context(run, c, deadline, stream=False, read=found)
                logits = run.text(c.feed)
        except BaseException:
            run.cache.release()  # a prompt that failed gives its kept buffers back at once
            raise
        return run, uses, logits

    def _generation(self, c: Continuation, run: Prefill, uses: list[StateUse], said: list[str], sampler: Any,
                    tokens: list[int], text: TextDecoder, first_logits: Any, *, ttft_s: float, decode_s: float,
                    began: float) -> Generation:
        mode = mode_of(uses, memo=c.memo)
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
                per_token_ms=decode_s * 1e3 / (len(tokens) - 1) if len(tokens) > 1 else 0.0,
            ),
            first_token_logits_sha256=logits_sha256(first_logits),
            model_fingerprint=self.runner.model.fingerprint.digest,
            hardware_fingerprint=self.identity.hardware.digest,
            sampling=sampler.sampling,
            recompute_ratio=c.blend if any(u.source == "approximate" for u in uses) else None,
            notes=said,
            layout=c.layout,
        )
        return Generation(text=text.text.strip(), tokens=list(c.known) + tokens, receipt=receipt,
                          first_token_logits=first_logits, finish_reason="stop" if text.done else "length")
