"""`kvrag serve --api-key`: a real server process that asks who you are, driven by the openai client,
LangChain's `ChatOpenAI` and LlamaIndex's `OpenAILike`. Two tenants on one server and one Redis
see neither each other's states nor each other's memo."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from kvrag import KVEngine, Provenance
from kvrag.testing import KVRagServer, RedisServer
from kvrag.trust import derive_tenant_key
from tests.conftest import DOC_A, QUESTION, READ_AS_TEXT, tiny

MODEL = "tiny-random-llama"
OPERATOR = "operator-secret-for-the-auth-tests"
KEY_A, KEY_B = "key-of-tenant-a-0123456789", "key-of-tenant-b-0123456789"


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(redis, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    keys = folder / "keys.txt"
    keys.write_text(f"# key tenant\n{KEY_A} tenant-a\n{KEY_B} tenant-b\n")
    served = KVRagServer(MODEL, redis.url, ("--api-key-file", str(keys)), log=folder / "serve.log",
                         env={"KVRAG_SIGNING_KEY": OPERATOR}, api_key=KEY_A).start()
    yield served
    served.stop(kill=True)


def client(server: KVRagServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def ask(server, key: str, document: str, **kvrag):
    return client(server, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=6,
        extra_body={"kvrag": {"documents": [document], **kvrag}})


def receipt(response) -> dict:
    return response.model_extra["kvrag_receipt"]


@pytest.mark.parametrize("key", ["", "wrong-key-0123456789", KEY_A + "x", KEY_A[:-1]])
def test_a_missing_or_wrong_key_gets_401_in_openais_shape(server, key):
    with pytest.raises(openai.AuthenticationError) as refused:
        ask(server, key or "-", DOC_A)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    for path in ("/v1/models", "/health", "/metrics"):
        raw = httpx.get(server.base + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        assert raw.status_code == 401 and raw.json()["error"]["code"] == "invalid_api_key"
        assert raw.headers["www-authenticate"] == "Bearer"


def test_a_working_key_answers_and_grafts_the_second_time(server):
    document = f"{DOC_A} (Case {uuid.uuid4().hex[:8]}.)"
    cold, warm = ask(server, KEY_A, document, memo=False), ask(server, KEY_A, document, memo=False)
    assert receipt(cold)["mode"] in READ_AS_TEXT and receipt(warm)["mode"] == "exact-graft"
    assert receipt(warm)["first_token_logits_sha256"] == receipt(cold)["first_token_logits_sha256"]
    assert httpx.get(server.base + "/health", headers={"Authorization": f"Bearer {KEY_B}"}).status_code == 200


def test_two_tenants_on_one_server_see_neither_states_nor_memo_of_the_other(server, redis):
    document = f"{DOC_A} (Case {uuid.uuid4().hex[:8]}.)"
    assert receipt(ask(server, KEY_A, document, memo=False))["mode"] in READ_AS_TEXT
    assert receipt(ask(server, KEY_A, document, memo=False))["mode"] == "exact-graft"
    # tenant-b asks the same: its own state, not tenant-a's (which it can neither address nor check)
    b = ask(server, KEY_B, document, memo=False)
    assert receipt(b)["mode"] in READ_AS_TEXT
    assert [s["reason"] for s in receipt(b)["states"] if s["reason"]] == ["missing"]
    assert receipt(b)["first_token_logits_sha256"] == receipt(ask(server, KEY_A, document, memo=False))[
        "first_token_logits_sha256"]  # the same answer, computed apart

    # A verified memo entry of tenant-a's (made with tenant-a's own key, in this process) answers
    # tenant-a's recurring question; tenant-b's same question is answered normally.
    own = KVEngine(tiny("llama"), redis.url, signing_key=derive_tenant_key(OPERATOR.encode(), "tenant-a"))
    assert own.namespace == "tenant-a"
    question = f"Who built it? ({uuid.uuid4().hex[:8]})"
    answer = own.generate(question, states=[document], max_new_tokens=6)
    own.memo.memoize(question, answer, states=[document], provenance=Provenance(kind="person", by="test"))

    def asked(key: str):
        return client(server, key).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=6,
            extra_body={"kvrag": {"documents": [document]}})

    assert receipt(asked(KEY_A))["mode"] == "memo"
    assert receipt(asked(KEY_B))["mode"] != "memo"
    metrics = httpx.get(server.base + "/metrics", headers={"Authorization": f"Bearer {KEY_A}"}).text
    assert 'kvrag_tenant_requests_total{status="200",tenant="tenant-a"}' in metrics
    assert 'kvrag_tenant_requests_total{status="200",tenant="tenant-b"}' in metrics


def test_langchain_chat_openai_with_a_key_that_works_and_one_that_does_not(server):
    from langchain_openai import ChatOpenAI

    good = ChatOpenAI(model=MODEL, base_url=server.url, api_key=KEY_B, max_tokens=4, temperature=0, max_retries=0)
    assert good.invoke("Say hello.").response_metadata["model_name"] == MODEL
    bad = ChatOpenAI(model=MODEL, base_url=server.url, api_key="not-a-key-0123", max_tokens=4, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.invoke("Say hello.")


def test_llamaindex_openai_like_with_a_key_that_works_and_one_that_does_not(server):
    from llama_index.llms.openai_like import OpenAILike

    good = OpenAILike(model=MODEL, api_base=server.url, api_key=KEY_A, is_chat_model=True, max_tokens=4,
                      max_retries=0, temperature=0.0)
    expected = client(server, KEY_A).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4).choices[0].message.content
    assert good.complete("Say hello.").text == expected  # greedy: the same answer as the openai client's
    bad = OpenAILike(model=MODEL, api_base=server.url, api_key="not-a-key-0123", is_chat_model=True, max_tokens=4,
                     max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.complete("Say hello.")


def unseen(text: str) -> str:
    return f"{text} (Case {uuid.uuid4().hex[:8]}.)"


def _process(pid: int) -> dict[str, int]:
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return {"threads": int(status["Threads"]), "rss_kib": int(status["VmRSS"].split()[0])}


def test_eight_tenants_share_one_runtime(redis, tmp_path):
    """One request from each of 8 tenants, each read as text and deposited in the background: one
    deposit worker and one buffer pool for all (the worker's threads do not grow with its tenants),
    and its memory not past 1.2x what it held after the first tenant's."""
    keys = {f"key-of-tenant-{i}-0123456789": f"tenant-{i}" for i in range(8)}
    (tmp_path / "keys.txt").write_text("".join(f"{key} {tenant}\n" for key, tenant in keys.items()))
    served = KVRagServer(MODEL, redis.url, ("--api-key-file", str(tmp_path / "keys.txt")), log=tmp_path / "serve.log",
                         env={"KVRAG_SIGNING_KEY": OPERATOR}, api_key=next(iter(keys))).start()
    try:
        seen = []
        for key in keys:
            answer = ask(served, key, unseen(DOC_A))
            assert receipt(answer)["mode"] in READ_AS_TEXT
            health = httpx.get(served.base + "/health", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
            while health["deposits"]["queued"] > health["deposits"]["deposited"] + health["deposits"]["failed"]:
                health = httpx.get(served.base + "/health", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
            seen.append(_process(health["worker"]))
        assert health["tenants"] == 9 and health["deposits"]["deposited"] == 8  # 8 tenants and the server's own
        assert seen[-1]["threads"] <= seen[0]["threads"], seen
        assert seen[-1]["rss_kib"] <= 1.2 * seen[0]["rss_kib"], seen
    finally:
        served.stop(kill=True)
