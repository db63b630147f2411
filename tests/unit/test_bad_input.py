"""Bad input gets a typed error with a clear message, and nothing is stored."""

import json

import pytest

from kvrag import (
    ContextTooLongError,
    EmptyTextError,
    ForeignStateError,
    InputError,
    IntegrityError,
    KVEngine,
    MemoryStore,
    StateNotFoundError,
)
from kvrag.artifacts.format import parse_manifest
from kvrag.trust.signing import sign_manifest

from ..conftest import DOC_A, DOC_B, QUESTION, resigned, tiny


def _stored(engine):
    return list(engine.store.keys())


@pytest.mark.parametrize("text", ["", "   \n\t "])
def test_empty_text(llama_engine, text):
    with pytest.raises(EmptyTextError, match="empty"):
        llama_engine.deposit(text)
    with pytest.raises(EmptyTextError):
        llama_engine.generate(text)
    assert _stored(llama_engine) == []


def test_text_longer_than_the_model_positions(llama_engine):
    with pytest.raises(ContextTooLongError, match="4096"):
        llama_engine.deposit("word " * 1000)  # 5,000 byte-level tokens
    with pytest.raises(ContextTooLongError):
        llama_engine.generate(QUESTION, states=["word " * 1000])
    assert _stored(llama_engine) == []


def test_a_state_from_another_model():
    theirs = KVEngine(tiny("qwen2"), MemoryStore())
    ours = KVEngine(tiny("llama"), MemoryStore())
    foreign = theirs.deposit(DOC_A)
    with pytest.raises(ForeignStateError, match="another model"):
        ours.deposit(DOC_B, after=foreign)
    with pytest.raises(ForeignStateError):
        ours.restore(foreign)
    assert _stored(ours) == []

    # Their state (same user, same signing key) under our key, its manifest saying so and signed:
    # the model fingerprint refuses it, and the text answers.
    ours_ref = ours.ref(DOC_A)
    planted = parse_manifest(theirs.store.read_manifest(foreign.key)).model_copy(update={"key": ours_ref.key})
    planted = sign_manifest(planted, ours.signing_key)
    ours.store.put(ours_ref.key, planted.to_json_bytes(), theirs.store.read(foreign.key).payload)
    with pytest.raises(ForeignStateError, match="another model"):
        ours.restore(ours_ref)
    generation = ours.generate(QUESTION, states=[ours_ref], max_new_tokens=2)
    assert generation.receipt.mode == "text-prefill" and generation.receipt.states[0].reason == "foreign"
    assert "another model" in generation.receipt.states[0].detail


def test_a_manifest_whose_payload_hash_does_not_match(llama_engine):
    ref = llama_engine.deposit(DOC_A)
    payload = bytearray(llama_engine.store.read(ref.key).payload)
    payload[-1] ^= 0xFF
    llama_engine.store.put(ref.key, llama_engine.store.read_manifest(ref.key), bytes(payload))
    with pytest.raises(IntegrityError, match="does not match its manifest \\(blake3-keyed/1 check failed\\)"):
        llama_engine.restore(ref)
    receipt = llama_engine.generate(QUESTION, states=[ref], max_new_tokens=2).receipt
    assert receipt.mode == "text-prefill" and receipt.states[0].reason == "integrity"
    assert "blake3-keyed/1 check failed" in receipt.states[0].detail


def test_a_chain_whose_parent_is_missing(llama_engine):
    parent = llama_engine.ref(DOC_A)  # never deposited
    with pytest.raises(StateNotFoundError):
        llama_engine.deposit(DOC_B, after=parent)
    assert _stored(llama_engine) == []


def test_an_unverified_state_is_never_grafted(llama_engine):
    ref = llama_engine.deposit(DOC_A)
    data = json.loads(llama_engine.store.read_manifest(ref.key))
    data["deposit"]["verified"] = False
    llama_engine.store.put(ref.key, resigned(llama_engine, data), llama_engine.store.read(ref.key).payload)
    with pytest.raises(IntegrityError, match="verified"):
        llama_engine.restore(ref)


def test_bad_max_new_tokens(llama_engine):
    with pytest.raises(InputError, match="max_new_tokens"):
        llama_engine.generate(QUESTION, max_new_tokens=0)
