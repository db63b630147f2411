"""Recurring queries: answered from verified state for a few decode tokens, or answered normally."""

from __future__ import annotations

import json

import pytest

from kvrag import InputError, KVEngine, MemoryStore
from kvrag.reuse.memo import MemoEntry, Provenance, canonical_query

from ..conftest import DOC_A, DOC_B, QUESTION, tiny

GOLD = Provenance(kind="gold", by="test")


@pytest.fixture
def engine():
    return KVEngine(tiny("qwen2"), MemoryStore())


def test_canonical_form():
    assert canonical_query("  Who built the LIGHTHOUSE?? ") == canonical_query("who  built the lighthouse") == "who built the lighthouse"
    assert canonical_query("ｗｈｏ built it！") == "who built it"  # NFKC


def test_a_recurring_query_is_a_memo_hit_with_few_decode_tokens(engine):
    first = engine.generate(QUESTION, states=[DOC_A, DOC_B], max_new_tokens=24)
    assert first.receipt.decode_tokens > 8
    entry = engine.memo.memoize(QUESTION, first, states=[DOC_A, DOC_B], provenance=GOLD)
    again = engine.generate("who built the lighthouse", states=[DOC_A, DOC_B], max_new_tokens=24)
    assert again.receipt.mode == "memo" and again.receipt.exact
    assert again.receipt.decode_tokens <= 8 and again.receipt.tokens_prefilled == 1
    assert again.text == first.text and entry.provenance.kind == "gold"
    # Other context, other memo: the same words after other documents are answered normally.
    assert engine.generate(QUESTION, states=[DOC_B], max_new_tokens=4).receipt.mode != "memo"


def test_an_unverified_entry_is_answered_normally(engine):
    first = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=16)
    with pytest.raises(InputError):
        engine.memo.memoize(QUESTION, first, states=[DOC_A])  # verified needs a provenance
    engine.memo.memoize(QUESTION, first, states=[DOC_A], verified=False)
    assert engine.generate(QUESTION, states=[DOC_A], max_new_tokens=16).receipt.mode == "exact-graft"


def test_an_entry_whose_state_fails_its_checks_is_answered_normally(engine):
    first = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=16)
    entry = engine.memo.memoize(QUESTION, first, states=[DOC_A], provenance=GOLD)
    payload = bytearray(engine.store.read(entry.state_key).payload)
    payload[-3] ^= 0x10
    engine.store.put(entry.state_key, engine.store.read_manifest(entry.state_key), bytes(payload))
    answer = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=16)
    assert answer.receipt.mode == "exact-graft" and answer.text == first.text

    engine.store.delete(entry.state_key)
    assert engine.generate(QUESTION, states=[DOC_A], max_new_tokens=16).receipt.mode == "exact-graft"

    # An entry sealed with our key but naming a state key that is not its own: refused too.
    name = f"memo/{entry.memo_key}"
    forged = MemoEntry.model_validate_json(engine.records.get(name))
    data = json.loads(forged.model_dump_json())
    data["state_key"] = "0" * 64
    engine.records.put(name, json.dumps(data).encode())
    assert engine.generate(QUESTION, states=[DOC_A], max_new_tokens=16).receipt.mode == "exact-graft"


def test_near_matches_are_suggestions_never_answers(engine):
    first = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=16)
    engine.memo.memoize(QUESTION, first, states=[DOC_A], provenance=GOLD)
    near = "Who constructed the lighthouse?"
    assert engine.generate(near, states=[DOC_A], max_new_tokens=4).receipt.mode == "exact-graft"
    suggestions = engine.memo.suggestions(near)
    assert suggestions and suggestions[0][0].query == QUESTION and 0 < suggestions[0][1] < 1
