"""The OpenAI wire format and the worker's bounded hot tier, without a server process: requests
validated, unsupported fields refused by name, responses shaped as OpenAI's clients parse them
(an in-process ASGI client over a tiny model)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from kvrag import KVEngine, MemoryStore, StoreError
from kvrag.server.app import ServeSettings, create_app
from kvrag.server.protocol import ChatRequest, CompletionRequest
from kvrag.server.serving_chat import question_of
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


@pytest.mark.parametrize("body, named", [
    ({"max_token": 3}, "max_token"),  # a typo of max_tokens
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"stream_options": {"include_usage": True, "chunk_size": 2}}, "chunk_size"),
    ({"messages": [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}]}, "cache_control"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "detail": "low"}]}]}, "detail"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]}, "tool_calls"),
])
def test_unknown_or_unhonoured_fields_anywhere_get_a_400_that_names_them(body, named):
    engine = KVEngine(tiny("llama"), MemoryStore())
    with TestClient(create_app(ServeSettings(model=MODEL), engine)) as http:
        request = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": QUESTION}], **body}
        response = http.post("/v1/chat/completions", json=request)
        assert response.status_code == 400
        error = response.json()["error"]
        assert named in error["message"] and error["type"] == "invalid_request_error"


def test_the_fields_ignored_on_purpose_are_accepted():
    from kvrag.server.protocol import IGNORED_FIELDS, IGNORED_MESSAGE_FIELDS

    assert set(IGNORED_FIELDS) == {"user", "metadata", "store", "service_tier"} and IGNORED_MESSAGE_FIELDS == ("name",)
    request = chat(user="u1", metadata={"run": "7"}, store=False, service_tier="auto",
                   messages=[{"role": "user", "content": "hi", "name": "ana"}])
    assert request.conversation() == [{"role": "user", "content": "hi"}]


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
    with pytest.raises(StoreError, match="max_mib"):
        open_store("memory://?max_mib=lots")


def test_the_port_answers_503_loading_while_the_model_loads(monkeypatch):
    import threading

    loaded = threading.Event()
    real_open = KVEngine.open

    def slow_open(*args, **kwargs):
        loaded.wait(30)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(KVEngine, "open", slow_open)
    with TestClient(create_app(ServeSettings(model=MODEL, store="memory://"))) as http:
        for path in ("/health", "/v1/models"):
            early = http.get(path)
            assert early.status_code == 503 and early.json()["error"]["code"] == "loading"
            assert early.headers["Retry-After"] == "2"
        loaded.set()
        for _ in range(300):
            if http.get("/health").status_code == 200:
                break
            threading.Event().wait(0.1)
        assert http.get("/health").json()["status"] == "ok"


def test_api_keys_map_to_tenants_and_guard_every_route_unless_health_is_open():
    from kvrag.server.app import ApiKey
    from kvrag.server.auth import authorized_tenant

    keys = [ApiKey(key="alpha-key-000", tenant="a"), ApiKey(key="beta-key-0000", tenant="b"), ApiKey(key="own-key-0000")]
    settings = ServeSettings(model=MODEL, api_keys=keys)
    assert [authorized_tenant(keys, h) for h in ("Bearer alpha-key-000", "bearer beta-key-0000", "Bearer own-key-0000")] == \
        ["a", "b", ""]
    for refused in (None, "", "Bearer", "Bearer ", "Basic alpha-key-000", "Bearer alpha-key-00", "Bearer alpha-key-0000"):
        assert authorized_tenant(keys, refused) is None, refused
    engine = KVEngine(tiny("llama"), MemoryStore())
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": QUESTION}],
            "kvrag": {"documents": [DOC_A], "memo": False}}
    with TestClient(create_app(settings, engine)) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 401
        assert http.get("/health").status_code == 401 and http.get("/metrics").status_code == 401
        ok = http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer alpha-key-000"})
        assert ok.status_code == 200 and ok.json()["kvrag_receipt"]["mode"] == "text-prefill"
        again = http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer alpha-key-000"})
        other = http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer beta-key-0000"})
        assert again.json()["kvrag_receipt"]["mode"] == "exact-graft"
        assert other.json()["kvrag_receipt"]["mode"] == "text-prefill"  # tenant b: nothing of a's
    with TestClient(create_app(settings.model_copy(update={"open_health": True}), engine)) as http:
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        assert http.get("/v1/models").status_code == 401
