"""A property over every kind of stored bytes, against a real Redis: whatever a writer changes in a
manifest, a payload frame, a frame table, a memo entry or a cache entry, the answer is either
what the genuine bytes give, or the text's (the bytes refused) - never anything else."""

from __future__ import annotations

import json

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration
from langchain_kvrag import KVCache

from kvrag.reuse.memo import Provenance
from kvrag.testing import RedisServer

from ..conftest import DOC_A, QUESTION
from .conftest import engine, text_logits

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    victim = engine(f"{server.url}?frame_mib=0.01")
    ref = victim.deposit(DOC_A)
    first = victim.generate(QUESTION, states=[ref], max_new_tokens=8, memo=False)
    entry = victim.memo.memoize(QUESTION, first, states=[DOC_A], provenance=Provenance(kind="gold", by="property"))
    memo_answer = victim.generate(QUESTION, states=[ref], max_new_tokens=8)
    assert memo_answer.receipt.mode == "memo"
    raw = redis.Redis(port=server.port)
    keys = sorted(k.decode() for k in raw.scan_iter(match=f"kvrag:{{{ref.key}}}:*"))
    yield {"server": server, "victim": victim, "ref": ref, "raw": raw, "state_keys": keys,
           "memo_blob": f"kvrag:blob:memo/{entry.memo_key}", "memo_tokens": memo_answer.tokens,
           "text": text_logits(), "first": first}
    server.stop()


def _mutate(data: bytes, draw) -> bytes:
    action = draw(st.sampled_from(["flip", "cut", "extend", "replace", "splice-json"]))
    out = bytearray(data)
    if action == "flip" and out:
        for _ in range(draw(st.integers(1, 4))):
            out[draw(st.integers(0, len(out) - 1))] ^= draw(st.integers(1, 255))
    elif action == "cut":
        out = out[: draw(st.integers(0, max(len(out) - 1, 0)))]
    elif action == "extend":
        out += draw(st.binary(min_size=1, max_size=64))
    elif action == "replace":
        out = bytearray(draw(st.binary(max_size=256)))
    else:
        try:
            value = json.loads(out)
        except ValueError:
            return bytes(out) + b" "
        if isinstance(value, dict) and value:
            field = draw(st.sampled_from(sorted(value)))
            value[field] = draw(st.none() | st.integers(-(2**70), 2**70) | st.text(max_size=20) | st.booleans())
        out = bytearray(json.dumps(value).encode())
    return bytes(out)


@SETTINGS
@given(st.data())
def test_a_mutated_state_record_or_frame_answers_as_the_genuine_state_or_as_the_text(world, data):
    raw, victim, ref = world["raw"], world["victim"], world["ref"]
    name = data.draw(st.sampled_from(world["state_keys"]))
    genuine = raw.get(name)
    raw.set(name, _mutate(genuine, data.draw))
    try:
        answer = victim.generate(QUESTION, states=[ref], max_new_tokens=1, memo=False)
    finally:
        raw.set(name, genuine)
    assert answer.receipt.first_token_logits_sha256 == world["text"]
    assert answer.receipt.mode in ("exact-graft", "text-prefill")


@SETTINGS
@given(st.data())
def test_a_mutated_memo_entry_answers_as_the_genuine_entry_or_normally(world, data):
    raw, victim, ref = world["raw"], world["victim"], world["ref"]
    genuine = raw.get(world["memo_blob"])
    raw.set(world["memo_blob"], _mutate(genuine, data.draw))
    try:
        answer = victim.generate(QUESTION, states=[ref], max_new_tokens=8)
    finally:
        raw.set(world["memo_blob"], genuine)
    if answer.receipt.mode == "memo":
        assert answer.tokens == world["memo_tokens"]
    else:
        assert answer.receipt.mode == "exact-graft" and answer.tokens == world["first"].tokens


@SETTINGS
@given(st.data())
def test_a_mutated_cache_entry_is_the_genuine_one_or_a_miss(world, data):
    cache = KVCache(world["server"].url)
    genuine = [ChatGeneration(message=AIMessage(content="Mara Quill built it."))]
    cache.update("prompt", "llm", genuine)
    name = f"kvrag:blob:{cache._name('prompt', 'llm')}"  # noqa: SLF001 - the slot an attacker rewrites
    sealed = world["raw"].get(name)
    world["raw"].set(name, _mutate(sealed, data.draw))
    found = cache.lookup("prompt", "llm")
    assert found is None or [g.text for g in found] == ["Mara Quill built it."]
