"""Memo entries rewritten, moved or edited in a shared Redis never answer."""

from __future__ import annotations

import json

import pytest

from kvrag.reuse.memo import MemoEntry, Provenance

from ..conftest import DOC_A
from .conftest import engine, text_logits

A, B = "Who built the lighthouse?", "How tall is the tower?"
GOLD = Provenance(kind="gold", by="attack test")


def _raw(server):
    import redis

    return redis.Redis(port=server.port)


def _blob(server, key):
    return f"kvrag:blob:memo/{key}"


@pytest.fixture
def memoized(server):
    victim = engine(server.url)
    entries = {}
    for question in (A, B):
        first = victim.generate(question, states=[DOC_A], max_new_tokens=8)
        entries[question] = victim.memo.memoize(question, first, states=[DOC_A], provenance=GOLD)
    assert victim.generate(A, states=[DOC_A], max_new_tokens=8).receipt.mode == "memo"
    return victim, entries


def _answered_normally(victim, question):
    answer = victim.generate(question, states=[DOC_A], max_new_tokens=1)
    assert answer.receipt.mode == "exact-graft"
    assert answer.receipt.first_token_logits_sha256 == text_logits(question=question)
    return answer


def test_a_memo_entry_copied_into_another_questions_slot_never_answers(server, memoized):
    victim, entries = memoized
    raw = _raw(server)
    raw.set(_blob(server, entries[A].memo_key), raw.get(_blob(server, entries[B].memo_key)))
    _answered_normally(victim, A)


def test_an_entry_flipped_to_verified_or_with_an_edited_answer_id_never_answers(server, memoized):
    victim, entries = memoized
    raw = _raw(server)
    name = _blob(server, entries[A].memo_key)
    sealed = raw.get(name)
    header, body = sealed.split(b"\n", 1)
    for edit in ("verified", "answer_id"):
        data = json.loads(body)
        if edit == "verified":
            data["verified"], data["provenance"] = True, None
        else:
            data["answer_ids"][-1] = (data["answer_ids"][-1] + 1) % 200
        for forged in (header + b"\n" + json.dumps(data).encode(), json.dumps(data).encode()):  # kept seal, no seal
            raw.set(name, forged)
            _answered_normally(victim, A)
    raw.set(name, sealed)
    assert victim.generate(A, states=[DOC_A], max_new_tokens=8).receipt.mode == "memo"


def test_an_entry_sealed_by_another_key_never_answers(server, memoized):
    victim, entries = memoized
    attacker = engine(server.url, signing_key="attacker")
    name = f"memo/{entries[A].memo_key}"
    entry = MemoEntry.model_validate_json(victim.records.get(name))
    attacker.records.put(name, entry.model_dump_json().encode())
    _answered_normally(victim, A)


@pytest.mark.parametrize("edit", ["blank query", "huge token id", "negative token id", "not json", "deep nesting"])
def test_entries_that_would_crash_a_parser_are_answered_normally(server, memoized, edit):
    """Even sealed with the victim's own key (an insider, or a bug), these never crash an answer."""
    victim, entries = memoized
    name = f"memo/{entries[A].memo_key}"
    data = json.loads(victim.records.get(name))
    if edit == "blank query":
        data["query"], data["canonical"] = "   ", ""
    elif edit == "huge token id":
        data["answer_ids"][0] = 2**64
    elif edit == "negative token id":
        data["answer_ids"][0] = -1
    body = json.dumps(data).encode()
    if edit == "not json":
        body = b"\xff\xfe not json"
    elif edit == "deep nesting":
        body = b"[" * 200_000 + b"]" * 200_000
    victim.records.put(name, body)
    _answered_normally(victim, A)
