""""Why did this not graft?": a segment read as text names what is stored for the same text under
other settings and which field differs; only data signed with the engine's key is read, and a
forged, oversized or foreign record is ignored without failing the answer."""

from __future__ import annotations

import json

from kvrag import KVEngine, MemoryStore
from kvrag.core.whereabouts import MAX_KEYS
from kvrag.trust.signing import seal

from ..conftest import DOC_A, DOC_B, QUESTION, tiny

KEY = b"k" * 32


def _engine(store, **kwargs) -> KVEngine:
    model = kwargs.pop("model", None) or tiny("llama", kwargs.pop("dtype", "float32"))
    return KVEngine(model, store, signing_key=kwargs.pop("signing_key", KEY), **kwargs)


def _fields(engine: KVEngine, texts: list[str], index: int = 0) -> list[str]:
    segment = engine.plan(texts)[index]
    (seen,) = engine.whereabouts.sightings(segment)
    return [d.field for d in seen.differences]


def test_another_dtype_is_named_in_the_receipt_and_by_sightings():
    store = MemoryStore()
    _engine(store).deposit(DOC_A)
    bf16 = _engine(store, dtype="bfloat16")
    generation = bf16.generate(QUESTION, states=[DOC_A], max_new_tokens=1)
    use = generation.receipt.states[0]
    assert use.reason == "missing" and "model.dtype (float32 stored, bfloat16 here)" in use.detail
    assert "model.dtype" in _fields(bf16, [DOC_A])


def test_another_position_and_another_layout_are_named():
    store = MemoryStore()
    chat = _engine(store)
    chat.deposit(DOC_A)
    assert _fields(chat, [DOC_B, DOC_A], 1) == ["start", "parent", "token_ids"]
    completion = _engine(store, layout="completion")
    assert _fields(completion, [DOC_A]) == ["layout", "token_ids"]


def test_a_graftable_state_needs_no_explanation_and_a_new_text_has_none():
    store = MemoryStore()
    engine = _engine(store)
    engine.deposit(DOC_A)
    assert engine.whereabouts.sightings(engine.plan([DOC_A])[0]) == []  # its own key is not "elsewhere"
    assert engine.whereabouts.describe(engine.plan([DOC_B])[0]) == ""


def test_another_tenant_or_key_sees_nothing_of_these_states():
    store = MemoryStore()
    _engine(store, namespace="acme").deposit(DOC_A)
    other_tenant = _engine(store, namespace="globex", dtype="bfloat16")
    assert other_tenant.whereabouts.sightings(other_tenant.plan([DOC_A])[0]) == []
    other_key = _engine(store, signing_key=b"o" * 32, dtype="bfloat16")
    assert other_key.whereabouts.sightings(other_key.plan([DOC_A])[0]) == []


def test_forged_oversized_and_malformed_records_are_ignored():
    store = MemoryStore()
    engine = _engine(store, dtype="bfloat16")
    segment = engine.plan([DOC_A])[0]
    slot = engine.whereabouts.slot(DOC_A)
    foreign = _engine(MemoryStore(), signing_key=b"o" * 32)
    foreign_ref = foreign.deposit(DOC_A)
    # a record sealed with another key, naming a real state
    store.put_blob(slot, seal(b"o" * 32, slot, json.dumps([foreign_ref.key]).encode()))
    assert engine.whereabouts.sightings(segment) == []
    # a record sealed with this key, naming a state whose manifest is signed with another key
    manifest = foreign.store.read_manifest(foreign_ref.key)
    store.put(foreign_ref.key, manifest, foreign.store.read(foreign_ref.key).payload)
    store.put_blob(slot, seal(KEY, slot, json.dumps([foreign_ref.key]).encode()))
    assert engine.whereabouts.sightings(segment) == []
    for body in (b"not json", b"{}", json.dumps(["x" * 64, 3, None]).encode(), b"[" + b'"' + b"a" * 64 + b'",' * 10_000,
                 b"[" * 1000):
        store.put_blob(slot, seal(KEY, slot, body))
        assert engine.whereabouts.sightings(segment) == []
        assert engine.generate(QUESTION, states=[DOC_A], max_new_tokens=1).receipt.mode == "text-prefill"


def test_a_record_keeps_the_most_recent_keys_only():
    store = MemoryStore()
    engine = _engine(store)
    texts = [f"{DOC_A} Variant {n}." for n in range(MAX_KEYS + 3)]
    slot = engine.whereabouts.slot(DOC_B)
    for text in texts:  # the same text, after MAX_KEYS + 3 different parents
        engine.deposit_chain([text, DOC_B])
    keys = json.loads(engine.records.get(slot))
    assert len(keys) == MAX_KEYS
    assert keys[0] == engine.plan([texts[-1], DOC_B])[1].key
