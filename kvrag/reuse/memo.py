"""Recurring queries answered from verified state.

A memo entry is the state of [the query + all but the last few tokens of a verified answer],
deposited after the same context chain. A recurring query (same canonical form, same model, same
retrieved states) grafts the context and that state, feeds the next answer token, and decodes only
what remains: a handful of decode tokens and no prefill beyond that one token. Only verified
entries answer, and only after the memo state passes every check a state must pass; anything else
is answered normally. Near-matches are suggestions, never answers.

Entries are sealed records (see `kvrag.trust.records`): a MAC over the whole entry and the slot it was
written to. Before an entry answers, its own canonical query, model and context keys must
recompute the slot it was read from, so an entry moved to another question's slot, edited, or
forged without the key is answered normally.
"""

from __future__ import annotations

import hashlib
import logging
import re
import unicodedata
from datetime import datetime, timezone
from typing import Literal, Sequence

from pydantic import BaseModel, Field

from kvrag.artifacts.format import TokenId
from kvrag.core.continuation import Continuation, Recall, plan_segments
from kvrag.core.deposit import Depositor
from kvrag.core.restore import Restorer
from kvrag.core.schedule import Planner, Segment, StateRef
from kvrag.errors import InputError, KVRagError, VerificationError
from kvrag.reuse.lexical import IndexedDoc, LexicalIndex
from kvrag.stores import UNTRUSTED_PARSE_ERRORS
from kvrag.stores.deadline import Deadline
from kvrag.trust.identity import EngineIdentity
from kvrag.trust.records import SealedRecords

__all__ = ["canonical_query", "Provenance", "MemoEntry", "Memo", "MEMO_TAIL_TOKENS"]

log = logging.getLogger("kvrag.memo")

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
    context_keys: list[str] = Field(max_length=4096)
    answer: str
    answer_ids: list[TokenId] = Field(max_length=1 << 16)
    state_key: str
    state_tokens: int
    tail: int = MEMO_TAIL_TOKENS  # answer tokens decoded at recall
    ended: bool  # the answer ended with an end token (not cut by max_new_tokens)
    verified: bool
    provenance: Provenance | None = None


def memo_key(scope: str, canonical: str, context_keys: Sequence[str]) -> str:
    """The slot of a memo entry: its engine's key scope, canonical query and context state keys."""
    digest = hashlib.sha256(b"kvrag-memo\x00" + scope.encode() + b"\x00" + canonical.encode())
    for key in context_keys:
        digest.update(b"\x00" + key.encode())
    return digest.hexdigest()


class Memo:
    """The memo of one engine: entries are sealed records `memo/<key>` in its store; memo states are
    deposited by its depositor and checked by its restorer. Memoizing runs a continuation (the
    memo state must reproduce the answer), so it is the engine's (`kvrag.engine.memo`): here are
    the entries, their states and the continuations that recall them."""

    def __init__(self, identity: EngineIdentity, planner: Planner, records: SealedRecords, depositor: Depositor,
                 restorer: Restorer, *, vocabulary: int, deadline_s: float) -> None:
        self.identity, self.planner, self.records = identity, planner, records
        self.depositor, self.restorer = depositor, restorer
        self.vocabulary, self.deadline_s = vocabulary, deadline_s

    def _key(self, query: str, segments: Sequence[Segment]) -> str:
        return memo_key(self.identity.scope, canonical_query(query), [s.key for s in segments])

    def entry(self, query: str, states: Sequence["StateRef | str"] = ()) -> MemoEntry | None:
        return self._load(self._key(query, self.planner.documents(_texts(states))))

    def _load(self, key: str, deadline: Deadline | None = None) -> MemoEntry | None:
        """The authentic entry in slot `key`, or None (absent, unreadable, not sealed with this
        engine's key for this slot, or not bound to this slot by its own fields)."""
        try:
            body = self.records.get(f"memo/{key}", deadline)
            if body is None:
                return None
            entry = MemoEntry.model_validate_json(body)
            bound = (
                entry.memo_key == key
                and canonical_query(entry.query) == entry.canonical
                and memo_key(self.identity.scope, entry.canonical, entry.context_keys) == key
                and entry.model_fingerprint == self.identity.model_digest
                and all(t < self.vocabulary for t in entry.answer_ids)
            )
            if not bound:
                log.warning("refused memo entry %s: its fields do not recompute its slot", key[:12])
            return entry if bound else None
        except (KVRagError, *UNTRUSTED_PARSE_ERRORS) as e:
            log.warning("memo entry %s unusable: %s", key[:12], str(e)[:200])
            return None

    def _segment(self, query: str, answer_ids: list[int], context: Sequence[Segment], tail: int) -> tuple[Segment, list[int]]:
        """The memo state's segment (the question and all but the answer's last `tail` + 1 tokens,
        after the context) and the answer ids it leaves out."""
        tail = min(tail, max(len(answer_ids) - 1, 0))
        kept = len(answer_ids) - tail - 1  # answer tokens inside the state; one more is fed at recall
        ids = self.planner.question(query, context) + answer_ids[:kept]
        after = context[-1] if context else None
        return self.planner.segment(f"memo:{canonical_query(query)}", ids, after), answer_ids[kept:]

    def prepare(
        self,
        query: str,
        answer_ids: list[int],
        answer: str,
        ended: bool,
        states: Sequence["StateRef | str"],
        provenance: Provenance | None,
        verified: bool,
        tail: int,
    ) -> tuple[MemoEntry, Continuation | None]:
        """The entry for an answer, its state deposited after the context chain, and (verified) the
        continuation whose tokens must be the answer's before `keep` writes it. A verified entry
        needs a provenance."""
        if verified and provenance is None:
            raise InputError("a verified memo entry needs a provenance: what verified the answer")
        segments = self.planner.documents(_texts(states))
        if not answer_ids:
            raise InputError("cannot memoize an empty answer")
        segment, remaining = self._segment(query, answer_ids, segments, tail)
        self.depositor.extend([*segments, segment])
        entry = MemoEntry(
            memo_key=self._key(query, segments),
            query=query,
            canonical=canonical_query(query),
            model_fingerprint=self.identity.model_digest,
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
        if not verified:
            return entry, None
        layout = self.planner.layout
        return entry, self._continuation(entry, segments, segment, len(remaining) + 1, None, layout.answer_stops, layout.kind)

    def keep(self, entry: MemoEntry, recalled: Sequence[int] | None) -> MemoEntry:
        """Write `entry`, given the tokens its check continuation decoded (None: unverified, no check)."""
        if recalled is not None and [t for t in recalled if t not in self.planner.layout.stop_ids] != entry.answer_ids:
            raise VerificationError("the memo state does not reproduce the verified answer; nothing memoized")
        self.records.put(f"memo/{entry.memo_key}", entry.model_dump_json().encode())
        return entry

    def find(self, query: str, segments: Sequence[Segment], deadline: Deadline | None = None) -> tuple[MemoEntry | None, str | None]:
        """A usable entry for this query and context, or why there is none worth noting."""
        entry = self._load(self._key(query, segments), deadline)
        if entry is None:
            return None, None
        if not entry.verified or entry.provenance is None:
            return None, "memo entry is unverified; answered normally"
        if entry.model_fingerprint != self.identity.model_digest:
            return None, "memo entry is from another model; answered normally"
        return entry, None

    def recall(self, query: str, segments: Sequence[Segment], max_new_tokens: int,
               deadline: Deadline | None = None) -> Continuation | None:
        """The continuation that answers from a verified entry for this query and context, or None
        (the engine then answers normally) when there is none or its memo state fails its checks."""
        deadline = deadline or Deadline(self.deadline_s)
        entry, _ = self.find(query, segments, deadline)
        if entry is None:
            return None
        try:
            memo_segment, _ = self._segment(entry.query, entry.answer_ids, segments, entry.tail)
            if memo_segment.key != entry.state_key or not entry.answer_ids:
                return None
            self.restorer.fetch(memo_segment.key, memo_segment, deadline)
        except (KVRagError, *UNTRUSTED_PARSE_ERRORS):
            return None
        layout = self.planner.layout
        return self._continuation(entry, segments, memo_segment, max_new_tokens, deadline, layout.answer_stops, layout.kind)

    @staticmethod
    def _continuation(entry: MemoEntry, context: Sequence[Segment], memo_segment: Segment, max_new_tokens: int,
                      deadline: Deadline | None = None, stop: Sequence[str] = (), layout: str = "") -> Continuation:
        """Graft the context and the memo state, feed the next answer token, decode what remains of
        the verified answer (and its end token if it had one)."""
        known = entry.answer_ids[: len(entry.answer_ids) - entry.tail]
        limit = min(max_new_tokens, len(entry.answer_ids) - len(known) + int(entry.ended))
        return Continuation([*plan_segments(context), Recall(memo_segment)], [known[-1]], limit, stop, known=known,
                            deadline=deadline, layout=layout)

    def suggestions(self, query: str, k: int = 3) -> list[tuple[MemoEntry, float]]:
        """Stored entries whose queries look like `query`: for a person to look at, never an answer."""
        entries = [e for name in self.records.names("memo") if (e := self._load(name.split("/", 1)[1]))]
        entries = [e for e in entries if e.model_fingerprint == self.identity.model_digest]
        if not entries:
            return []
        index = LexicalIndex([IndexedDoc(e.canonical, {"i": i}) for i, e in enumerate(entries)])
        return [(entries[d.metadata["i"]], score) for d, score in index.search(canonical_query(query), k) if score > 0]


def _texts(states: Sequence["StateRef | str"]) -> list[str]:
    return [s if isinstance(s, str) else s.text for s in states]
