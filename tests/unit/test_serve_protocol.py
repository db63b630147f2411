"""The OpenAI wire format and the worker's bounded hot tier, without a server process: requests
validated, unsupported fields refused by name, responses shaped as OpenAI's clients parse them
(an in-process ASGI client over a tiny model)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from kvrag import KVEngine, MemoryStore
from kvrag.server.app import ServeSettings, create_app, question_of
from kvrag.server.openai_api import ChatRequest, CompletionRequest
from kvrag.stores import open_store
from tests.conftest import DOC_A, QUESTION, tiny

MODEL = "tiny-random-llama"


def chat(**fields):
    return ChatRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("field, value", [("n", 3), ("logprobs", True), ("presence_penalty", 0.5),
                                          ("tools", [{"type": "function"}]), ("response_format", {"type": "json_object"}),
                                          ("stop", ["a", "b", "c", "d", "e"]), ("temperature", 2.5), ("top_p", 0)])
def test_what_kvrag_cannot_honour_is_refused_by_name(field, value):
    with pytest.raises(ValidationError) as e:
        chat(**{field: value})
    assert field in str(e.value)


def test_defaults_ask_for_nothing_unsupported_and_documents_take_two_shapes():
    request = chat(n=1, tool_choice="auto", response_format={"type": "text"}, stop="END",
                   kvrag={"documents": ["plain", {"text": "stamped", "state_key": "ab" * 32}]})
    assert request.stops == ["END"] and request.temperature == 0.0 and request.limit(64) == 64
    assert [d.state_key for d in request.kvrag.documents] == [None, "ab" * 32]
    with pytest.raises(ValidationError):
        chat(kvrag={"documents": [{"text": "x", "state_key": "not hex"}]})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": MODEL, "prompt": ["one", "two"]})
    assert chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
                ).conversation() == [{"role": "system", "content": "a\nb"}]


def test_question_after_documents_keeps_every_turn():
    assert question_of([{"role": "user", "content": "Why?"}]) == "Why?"
    assert question_of([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]) == \
        "System: Be brief.\nUser: Why?"


def test_an_in_process_app_answers_with_receipt_usage_and_worker_header():
    engine = KVEngine(tiny("llama"), MemoryStore())
    with TestClient(create_app(ServeSettings(model=MODEL), engine)) as http:
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": QUESTION}],
                "kvrag": {"documents": [DOC_A], "memo": False}}
        cold, warm = http.post("/v1/chat/completions", json=body), http.post("/v1/chat/completions", json=body)
        assert cold.status_code == warm.status_code == 200 and "x-kvrag-worker" in warm.headers
        assert warm.json()["kvrag_receipt"]["mode"] == "exact-graft"
        assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert warm.json()["choices"][0]["message"]["content"] == cold.json()["choices"][0]["message"]["content"]
        assert http.post("/v1/chat/completions", json={**body, "model": "other"}).status_code == 404


def test_the_hot_tier_is_an_lru_under_its_byte_cap():
    store = open_store("memory://?max_mib=0.001")  # 1,048 bytes
    keys = [f"{i:064x}" for i in range(4)]
    for key in keys[:2]:
        store.put(key, b"m" * 100, b"p" * 300)
    store.read(keys[0])  # refreshed: keys[1] is now the least recently used
    store.put(keys[2], b"m" * 100, b"p" * 300)
    assert sorted(store.keys()) == [keys[0], keys[2]] and store.bytes_held <= store.max_bytes
    store.put(keys[3], b"m", b"p" * 5000)  # larger than the cap: not kept, nothing evicted for it
    assert keys[3] not in store and sorted(store.keys()) == [keys[0], keys[2]]
    with pytest.raises(Exception):
        open_store("memory://?max_mib=lots")
