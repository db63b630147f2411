"""Prefix records (reuse at any boundary, invariant kernel) rewritten in a shared Redis graft
nothing they should not: a record is a sealed hint, and the chain it names is checked and
compared token by token with the prompt before any of it is grafted."""

from __future__ import annotations

import json

import redis

from kvrag import KVEngine
from kvrag.core.prefixes import prefix_marks
from kvrag.core.transcript import Message

from ..conftest import DOC_A, DOC_B, DOC_C, QUESTION, tiny
from .conftest import DEADLINE_S, MODEL_MARGIN_S, timed

ASKED = [{"role": "system", "content": "Answer from the documents."},
         {"role": "user", "content": f"{DOC_A}\n{DOC_B}\nQuestion: {QUESTION}"}]


def _engine(url):
    return KVEngine(tiny("llama", "float32", "invariant"), url, deadline_s=DEADLINE_S)


def _text(engine):
    return engine.chat(ASKED, max_new_tokens=1, graft=False).receipt.first_token_logits_sha256


def test_unsealed_or_garbage_prefix_records_are_ignored(server):
    victim = _engine(server.url)
    decoy = victim.deposit_chain([DOC_C])[0]
    ids = victim.renderer.render([Message(**m) for m in ASKED]).ids
    raw = redis.Redis(port=server.port)
    bodies = [json.dumps({"key": decoy.key}).encode(), b"\x00" * 10_000, b"{", b'{"key": 5}']
    for i, (_, name) in enumerate(prefix_marks(victim.identity.scope, ids)):
        raw.set(f"kvrag:blob:{name}", bodies[i % len(bodies)])  # written without the signing key
    answer, took = timed(lambda: victim.chat(ASKED, max_new_tokens=1))
    assert answer.receipt.first_token_logits_sha256 == _text(victim)
    # nothing of this prompt is stored and every record is unsealed: nothing grafts, the decoy least of all
    assert answer.receipt.tokens_reused == 0 and answer.receipt.mode == "text-prefill"
    assert all(u.key != decoy.key for u in answer.receipt.states)
    assert took < DEADLINE_S + MODEL_MARGIN_S


def test_a_resealed_record_naming_another_chain_grafts_only_shared_tokens(server):
    """Even a record sealed with the key (an insider) can only name a chain; its verified tokens
    decide how much is grafted, so the answer keeps the text's logits."""
    victim = _engine(server.url)
    decoy = victim.deposit_chain([DOC_C])[0]
    ids = victim.renderer.render([Message(**m) for m in ASKED]).ids
    for _, name in prefix_marks(victim.identity.scope, ids):
        victim.records.put(name, json.dumps({"key": decoy.key}).encode())
    answer = victim.chat(ASKED, max_new_tokens=1)
    decoy_ids = victim.plan([DOC_C])[0].ids
    shared = next(i for i, (a, b) in enumerate(zip(decoy_ids, ids)) if a != b)
    assert answer.receipt.tokens_reused == shared
    assert answer.receipt.first_token_logits_sha256 == _text(victim)
