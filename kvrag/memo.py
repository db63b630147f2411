"""Recurring queries answered from verified state.

A memo entry is the state of [the query + all but the last few tokens of a verified answer],
deposited after the same context chain. A recurring query (same canonical form, same model, same
retrieved states) grafts the context and that state, feeds the next answer token, and decodes only
what remains: a handful of decode tokens and no prefill beyond that one token. Only verified
entries answer, and only after the memo state passes every check a state must pass; anything else
is answered normally. Near-matches are suggestions, never answers.
"""

from __future__ import annotations

import hashlib
import re
import time
import unicodedata
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Iterator, Literal, Sequence

from pydantic import BaseModel, Field

from kvrag.errors import InputError, KVRagError, StateError, VerificationError
from kvrag.index import IndexedDoc, LexicalIndex
from kvrag.receipt import Receipt, StateUse, Timings

if TYPE_CHECKING:
    from kvrag.engine import Generation, KVEngine, StateRef, _Segment

__all__ = ["canonical_query", "Provenance", "MemoEntry", "Memo", "MEMO_TAIL_TOKENS"]

#: Answer tokens left out of a memo state and decoded at recall (plus the end token).
MEMO_TAIL_TOKENS = 4
_TRAILING = re.compile(r"[\s\.\?\!,;:…。？！]+$")


def canonical_query(text: str) -> str:
    """NFKC, case-folded, whitespace collapsed, trailing punctuation dropped."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return _TRAILING.sub("", " ".join(text.split()))


class Provenance(BaseModel):
    """What verified an answer: a checker function, a test, a person, or a gold answer."""

    kind: Literal["checker", "test", "person", "gold"]
    by: str
    at: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat())


class MemoEntry(BaseModel):
    format: Literal["kvrag.memo/1"] = "kvrag.memo/1"
    memo_key: str
    query: str
    canonical: str
    model_fingerprint: str
    context_keys: list[str]
    answer: str
    answer_ids: list[int]
    state_key: str
    state_tokens: int
    tail: int = MEMO_TAIL_TOKENS  # answer tokens decoded at recall
    ended: bool  # the answer ended with an end token (not cut by max_new_tokens)
    verified: bool
    provenance: Provenance | None = None


def memo_key(model_fingerprint: str, canonical: str, context_keys: Sequence[str]) -> str:
    digest = hashlib.sha256(b"kvrag-memo\x00" + model_fingerprint.encode() + b"\x00" + canonical.encode())
    for key in context_keys:
        digest.update(b"\x00" + key.encode())
    return digest.hexdigest()


class Memo:
    """The memo of one engine: entries are blobs `memo/<key>` in the engine's store."""

    def __init__(self, engine: "KVEngine") -> None:
        self.engine = engine

    def _key(self, query: str, segments: Sequence["_Segment"]) -> str:
        return memo_key(self.engine.fingerprint, canonical_query(query), [s.key for s in segments])

    def entry(self, query: str, states: Sequence["StateRef | str"] = ()) -> MemoEntry | None:
        texts = [getattr(s, "text", s) for s in states]
        return self._load(self._key(query, self.engine.plan(texts)))

    def _load(self, key: str) -> MemoEntry | None:
        try:
            raw = self.engine.store.get_blob(f"memo/{key}")
            return MemoEntry.model_validate_json(raw) if raw else None
        except (KVRagError, ValueError):
            return None

    def _segments(self, query: str, answer_ids: list[int], segments: Sequence["_Segment"], tail: int = MEMO_TAIL_TOKENS) -> tuple["_Segment", list[int]]:
        from kvrag.artifact import state_key
        from kvrag.engine import _Segment

        tail = min(tail, max(len(answer_ids) - 1, 0))
        kept = len(answer_ids) - tail - 1  # answer tokens inside the state; one more is fed at recall
        ids = self.engine.layout.question_ids(query) + answer_ids[:kept]
        parent = segments[-1].key if segments else None
        if parent is None:
            ids = list(self.engine.layout.prefix_ids) + ids
        start = segments[-1].end if segments else 0
        segment = _Segment(f"memo:{canonical_query(query)}", ids, state_key(self.engine.fingerprint, parent, ids), parent, start)
        return segment, answer_ids[kept:]

    def memoize(
        self,
        query: str,
        generation: "Generation",
        *,
        states: Sequence["StateRef | str"] = (),
        provenance: Provenance | None = None,
        verified: bool = True,
    ) -> MemoEntry:
        return self._memoize(query, [t for t in generation.tokens if t not in self.engine.layout.stop_ids],
                             generation.text, generation.finish_reason == "stop", states, provenance, verified, MEMO_TAIL_TOKENS)

    def memoize_text(
        self,
        query: str,
        answer: str,
        *,
        provenance: Provenance,
        states: Sequence["StateRef | str"] = (),
        decode_suffix: str | None = None,
    ) -> MemoEntry:
        """Memoize a verified answer written by someone else (a library solution).

        With `decode_suffix` (the final answer that ends `answer`), recall decodes those tokens
        if the model reproduces them exactly; otherwise the whole answer comes from the state.
        """
        ids = self.engine.model.tokenizer(answer, add_special_tokens=False)["input_ids"]
        if decode_suffix and answer.rstrip().endswith(decode_suffix.strip()):
            tail = len(self.engine.model.tokenizer(decode_suffix.strip(), add_special_tokens=False)["input_ids"])
            try:
                return self._memoize(query, ids, answer, False, states, provenance, True, tail)
            except VerificationError:
                pass
        return self._memoize(query, ids, answer, False, states, provenance, True, 0)

    def _memoize(
        self,
        query: str,
        answer_ids: list[int],
        answer: str,
        ended: bool,
        states: Sequence["StateRef | str"],
        provenance: Provenance | None,
        verified: bool,
        tail: int,
    ) -> MemoEntry:
        """Store `generation` (an answer to `query` after `states`) as a memo entry.

        A verified entry needs a provenance; its state is deposited after the context chain and
        checked to reproduce the answer's remaining tokens before the entry is written.
        """
        if verified and provenance is None:
            raise InputError("a verified memo entry needs a provenance: what verified the answer")
        engine = self.engine
        texts = [getattr(s, "text", s) for s in states]
        segments = engine.plan(texts)
        if not answer_ids:
            raise InputError("cannot memoize an empty answer")
        segment, remaining = self._segments(query, answer_ids, segments, tail)
        engine.deposit_chain(texts) if texts else None
        engine._deposit_segment(segment, segment.parent_key)
        entry = MemoEntry(
            memo_key=self._key(query, segments),
            query=query,
            canonical=canonical_query(query),
            model_fingerprint=engine.fingerprint,
            context_keys=[s.key for s in segments],
            answer=answer,
            answer_ids=answer_ids,
            state_key=segment.key,
            state_tokens=len(segment.ids),
            tail=min(tail, max(len(answer_ids) - 1, 0)),
            ended=ended,
            verified=verified,
            provenance=provenance,
        )
        if verified:
            recalled = self._recall(entry, segments, segment, max_new_tokens=len(remaining) + 1).result()
            got = [t for t in recalled.tokens if t not in engine.layout.stop_ids]
            if got != answer_ids:
                raise VerificationError("the memo state does not reproduce the verified answer; nothing memoized")
        engine.store.put_blob(f"memo/{entry.memo_key}", entry.model_dump_json().encode())
        return entry

    def find(self, query: str, segments: Sequence["_Segment"]) -> tuple[MemoEntry | None, str | None]:
        """A usable entry for this query and context, or why there is none worth noting."""
        entry = self._load(self._key(query, segments))
        if entry is None:
            return None, None
        if not entry.verified or entry.provenance is None:
            return None, "memo entry is unverified; answered normally"
        if entry.model_fingerprint != self.engine.fingerprint:
            return None, "memo entry is from another model; answered normally"
        return entry, None

    def recall(self, entry: MemoEntry, query: str, segments: Sequence["_Segment"], max_new_tokens: int) -> "Iterator[str] | None":
        """The answer stream from a verified entry, or None (with the engine answering normally)
        when the memo state fails its checks."""
        memo_segment, _ = self._segments(entry.query, entry.answer_ids, segments, entry.tail)
        if memo_segment.key != entry.state_key:
            return None
        try:
            self.engine._fetch(memo_segment.key, memo_segment)
        except StateError:
            return None
        return self._recall(entry, segments, memo_segment, max_new_tokens)

    def _recall(self, entry: MemoEntry, segments: Sequence["_Segment"], memo_segment: "_Segment", max_new_tokens: int):  # type: ignore[no-untyped-def]
        from kvrag.engine import Generation, GenerationStream, _Prefill, _TextDecoder, logits_sha256

        engine = self.engine

        def steps() -> Iterator[str]:
            began = time.perf_counter()
            run = _Prefill(engine)
            uses = []
            for segment in list(segments) + [memo_segment]:
                try:
                    fetched = run.graft(engine._fetch, segment.key, segment)
                    uses.append(StateUse(key=segment.key, start=segment.start, end=segment.end, source="graft", tier=fetched.tier))
                except StateError as e:
                    if segment is memo_segment:
                        raise
                    run.text(segment.ids)
                    uses.append(StateUse(key=segment.key, start=segment.start, end=segment.end, source="text", reason=e.reason, detail=str(e)))
            run.flush()
            known = entry.answer_ids[: len(entry.answer_ids) - entry.tail]
            logits = run.text([known[-1]])
            first_logits = logits.clone()
            ttft = time.perf_counter() - began
            decoder = _TextDecoder(engine.model.tokenizer, engine.layout.stop_ids, ())
            for token in known:
                for _ in decoder.push(token):
                    pass
            decoder.emitted = 0
            # Decode what remains of the verified answer, and its end token if it had one.
            limit = min(max_new_tokens, len(entry.answer_ids) - len(known) + int(entry.ended))
            tokens = [engine._pick(logits)] if limit > 0 else []
            for token in tokens:
                yield from decoder.push(token)
            t = time.perf_counter()
            while not decoder.done and len(tokens) < limit:
                tokens.append(engine._pick(engine._forward([tokens[-1]], run.cache)))
                yield from decoder.push(tokens[-1])
            yield from decoder.flush()
            receipt = Receipt(
                mode="memo",
                exact=True,
                states=uses,
                tokens_reused=run.reused,
                tokens_prefilled=run.prefilled,
                decode_tokens=len(tokens),
                timings=Timings(restore_ms=run.restore_s * 1e3, prefill_ms=run.prefill_s * 1e3, ttft_ms=ttft * 1e3,
                                decode_ms=(time.perf_counter() - t) * 1e3, total_ms=(time.perf_counter() - began) * 1e3),
                first_token_logits_sha256=logits_sha256(first_logits),
                model_fingerprint=engine.fingerprint,
                hardware_fingerprint=engine.hardware().digest,
            )
            return Generation(text=decoder.text.strip(), tokens=known + tokens, receipt=receipt,
                              first_token_logits=first_logits, finish_reason="stop" if entry.ended else "length")

        return GenerationStream(steps())

    def suggestions(self, query: str, k: int = 3) -> list[tuple[MemoEntry, float]]:
        """Stored entries whose queries look like `query`: for a person to look at, never an answer."""
        entries = [e for name in self.engine.store.blob_names("memo") if (e := self._load(name.split("/", 1)[1]))]
        entries = [e for e in entries if e.model_fingerprint == self.engine.fingerprint]
        if not entries:
            return []
        index = LexicalIndex([IndexedDoc(e.canonical, {"i": i}) for i, e in enumerate(entries)])
        return [(entries[d.metadata["i"]], score) for d, score in index.search(canonical_query(query), k) if score > 0]
