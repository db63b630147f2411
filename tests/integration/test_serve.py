"""`kvrag serve` as a real process on a free port, driven by real clients: the official `openai`
client (sync, async, streaming), LangChain's `ChatOpenAI` and LlamaIndex's `OpenAILike`, and
plain httpx for what clients hide (status codes, headers, overload, shutdown). Two servers share
one throwaway Redis, as two workers behind a load balancer would; answers and receipts are
checked against an in-process `KVEngine` on the same model."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid

import httpx
import openai
import pytest

from kvrag import KVEngine, MemoryStore
from kvrag.testing import KVRagServer, RedisServer
from tests.conftest import DOC_A, DOC_B, DOC_C, QUESTION, READ_AS_TEXT, tiny

MODEL = "tiny-random-llama"
TOKENS = 8


@pytest.fixture(scope="module")
def redis_shared(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server_a(redis_shared, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "a.log"
    server = KVRagServer(MODEL, redis_shared.url, ("--concurrency", "1", "--queue", "1"), log=log).start()
    yield server
    server.stop(kill=True)


@pytest.fixture(scope="module")
def server_b(redis_shared, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "b.log"
    server = KVRagServer(MODEL, redis_shared.url, log=log).start()
    yield server
    server.stop(kill=True)


@pytest.fixture(scope="module")
def local() -> KVEngine:
    """The same model in this process: what every server answer is compared with."""
    return KVEngine(tiny("llama"), MemoryStore())


def client(server: KVRagServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def ask(server: KVRagServer, question: str, documents: list[str], **extra):
    return client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=TOKENS,
        extra_body={"kvrag": {"documents": documents, **extra}})


def receipt(response) -> dict:
    return response.model_extra["kvrag_receipt"]


def unseen(text: str) -> str:
    """`text` made new to every server and store: a test that needs a cold first ask holds, run in
    any order, alone or after the others."""
    return f"{text} (Case {uuid.uuid4().hex[:8]}.)"


# ------------------------------------------------------------------------------ the openai client
def test_a_cold_answer_equals_the_in_process_engine_and_the_next_one_grafts(server_a, local):
    document = unseen(DOC_A)
    expected = local.generate(QUESTION, states=[document], max_new_tokens=TOKENS, memo=False)
    cold = ask(server_a, QUESTION, [document], memo=False)
    assert receipt(cold)["mode"] == "text-prefill"
    assert cold.choices[0].message.content == expected.text
    assert receipt(cold)["first_token_logits_sha256"] == expected.receipt.first_token_logits_sha256
    assert cold.usage.completion_tokens == expected.receipt.decode_tokens
    assert cold.usage.prompt_tokens == expected.receipt.tokens_prefilled
    assert cold.usage.prompt_tokens_details.cached_tokens == 0

    warm = ask(server_a, QUESTION, [document], memo=False)
    assert receipt(warm)["mode"] == "exact-graft"
    assert warm.choices[0].message.content == expected.text
    assert receipt(warm)["first_token_logits_sha256"] == expected.receipt.first_token_logits_sha256
    assert warm.usage.prompt_tokens_details.cached_tokens == receipt(warm)["tokens_reused"] > 0
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens


def test_streaming_deltas_add_up_to_the_answer_and_close_with_receipt_and_usage(server_a, local):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say something."}]
    expected = local.chat(messages, max_new_tokens=TOKENS)
    chunks = list(client(server_a).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=TOKENS, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    closing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(closing) == 1 and closing[0].choices[0].finish_reason == expected.finish_reason
    assert closing[0].model_extra["kvrag_receipt"]["first_token_logits_sha256"] == \
        expected.receipt.first_token_logits_sha256
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == expected.receipt.decode_tokens


def test_the_async_client_streams_and_answers(server_a, local):
    expected = local.generate("When was the lamp electrified?", states=[DOC_B], max_new_tokens=TOKENS, memo=False)

    async def run() -> tuple[str, str]:
        async with openai.AsyncOpenAI(base_url=server_a.url, api_key="unused", max_retries=0) as aclient:
            common = dict(model=MODEL, messages=[{"role": "user", "content": "When was the lamp electrified?"}],
                          max_tokens=TOKENS, extra_body={"kvrag": {"documents": [DOC_B], "memo": False}})
            whole = await aclient.chat.completions.create(**common)
            parts = [c.choices[0].delta.content or "" async for c in await aclient.chat.completions.create(
                **common, stream=True) if c.choices]
            return whole.choices[0].message.content, "".join(parts)

    whole, streamed = asyncio.run(run())
    assert whole == streamed == expected.text


def test_text_completions_read_the_prompt_as_one_user_message(server_a, local):
    expected = local.chat([{"role": "user", "content": "Complete this: the tower"}], max_new_tokens=TOKENS)
    response = client(server_a).completions.create(model=MODEL, prompt="Complete this: the tower", max_tokens=TOKENS)
    assert response.choices[0].text == expected.text
    assert response.model_extra["kvrag_receipt"]["first_token_logits_sha256"] == \
        expected.receipt.first_token_logits_sha256
    streamed = client(server_a).completions.create(model=MODEL, prompt="Complete this: the tower",
                                                   max_tokens=TOKENS, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text


def test_models_health_and_metrics(server_a):
    for _ in range(2):  # answers of its own to count (the second grafts), whatever ran before
        ask(server_a, QUESTION, [DOC_A], memo=False)
    models = client(server_a).models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(server_a.base + "/health").json()
    assert health["status"] == "ok" and [t["kind"] for t in health["tiers"]] == ["memory", "redis"]
    text = httpx.get(server_a.base + "/metrics").text
    for name in ("kvrag_requests_total", "kvrag_ttft_seconds_bucket", "kvrag_receipts_total", "kvrag_segments_total",
                 "kvrag_tokens_total", "kvrag_batch_rows_bucket"):
        assert name in text
    # started without --api-key: it says so, and who can reach it
    assert "no --api-key, so listening on 127.0.0.1 only (loopback)" in server_a.log.read_text()
    assert 'kvrag_receipts_total{mode="exact-graft"}' in text


def test_errors_have_openai_shape_and_status(server_a):
    c = client(server_a)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    assert "`n`" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=7)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "   "}])
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 20_000}])
    assert e.value.body["code"] == "context_length_exceeded"
    raw = httpx.post(server_a.url + "/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server_a.url + "/nowhere").json()["error"]["code"] == "not_found"


def test_sampling_with_a_seed_is_reproducible_and_stop_cuts(server_a):
    c = client(server_a)
    common = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me anything."}], max_tokens=TOKENS,
                  temperature=0.9, top_p=0.9, seed=7)
    first, second = (c.chat.completions.create(**common) for _ in range(2))
    assert first.choices[0].message.content == second.choices[0].message.content
    assert receipt(first)["sampling"]["seed"] == 7
    greedy = c.chat.completions.create(model=MODEL, messages=common["messages"], max_tokens=TOKENS)
    text = greedy.choices[0].message.content
    assert len(text) >= 3, text  # the stop string below is cut from it
    stop = text[1:3]
    cut = c.chat.completions.create(model=MODEL, messages=common["messages"], max_tokens=TOKENS, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------------------ framework clients
def test_langchain_chat_openai_pipeline_unchanged_grafts_its_stuffed_prompt(server_a, local):
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server_a.url, api_key="unused", max_tokens=TOKENS, temperature=0,
                     max_retries=0)
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Use the context to answer.\n\nContext:\n{context}"), ("human", "{question}")])
    chain = prompt | llm
    inputs = {"context": f"{DOC_A}\n\n{DOC_C}", "question": "How many steps are there?"}
    first = chain.invoke(inputs)
    second = chain.invoke(inputs)
    expected = local.chat([{"role": "system", "content": f"Use the context to answer.\n\nContext:\n{DOC_A}\n\n{DOC_C}"},
                           {"role": "user", "content": "How many steps are there?"}], max_new_tokens=TOKENS)
    assert first.content == second.content == expected.text
    assert second.usage_metadata["input_token_details"]["cache_read"] > 0
    assert (prompt | llm | StrOutputParser()).invoke(inputs) == expected.text
    assert "".join(c.content for c in chain.stream(inputs)) == expected.text


def test_llamaindex_openai_like_chat_and_complete(server_a, local):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=MODEL, api_base=server_a.url, api_key="unused", is_chat_model=True, max_tokens=TOKENS,
                     temperature=0.0, max_retries=0, context_window=4096)
    answer = llm.chat([ChatMessage(role="user", content="Who keeps the lamp?")])
    assert answer.message.content == local.chat([{"role": "user", "content": "Who keeps the lamp?"}],
                                                max_new_tokens=TOKENS).text
    assert llm.complete("Who keeps the lamp?").text == answer.message.content
    assert "".join(r.delta for r in llm.stream_complete("Who keeps the lamp?")) == answer.message.content


# --------------------------------------------------------------------------------- workers, load
def test_a_state_deposited_through_one_server_grafts_in_the_other_from_redis(server_a, server_b):
    question, document = "What is in the lantern room?", unseen(DOC_C)
    cold = ask(server_a, question, [document], memo=False)
    assert receipt(cold)["mode"] in READ_AS_TEXT
    # the deposit runs after the answer, off its path: server_a's next ask waits for it to be stored
    assert receipt(ask(server_a, question, [document], memo=False))["mode"] == "exact-graft"
    other = ask(server_b, question, [document], memo=False)
    assert receipt(other)["mode"] == "exact-graft"
    assert [s["tier"].split("://")[0] for s in receipt(other)["states"]] == ["redis"]
    assert other.choices[0].message.content == cold.choices[0].message.content
    assert receipt(other)["first_token_logits_sha256"] == receipt(cold)["first_token_logits_sha256"]


def test_beyond_the_queue_requests_get_429_with_retry_after(server_a):
    body = {"model": MODEL, "max_tokens": 400, "kvrag": {"graft": False}}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as h:
            return await asyncio.gather(*[
                h.post(server_a.url + "/chat/completions",
                       json={**body, "messages": [{"role": "user", "content": f"Count to {i}."}]})
                for i in range(6)])

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 2 and 429 in codes, codes  # one running, one waiting, the rest refused
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"


def test_concurrent_streams_share_the_batch_and_answer_as_each_alone(server_b, local):
    """server_b runs with the defaults: 16 generations at once, their decoding steps batched."""
    asks = [(QUESTION, [DOC_A]), ("When was the lamp electrified?", [DOC_B, DOC_C]), ("Say something.", [DOC_B]),
            ("What is in the lantern room?", [DOC_C]), ("Who retired in 1988?", [DOC_B, DOC_A]),
            ("Tell me about the tower.", [DOC_A, DOC_C])]
    expected = [local.generate(q, states=docs, max_new_tokens=24, memo=False) for q, docs in asks]
    before = httpx.get(server_b.base + "/health").json()["batch"]

    async def one(aclient: openai.AsyncOpenAI, index: int) -> tuple[str, dict | None]:
        await asyncio.sleep(0.03 * index)  # arrivals while the others decode
        question, documents = asks[index]
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=24, stream=True,
            extra_body={"kvrag": {"documents": documents, "memo": False}})
        text, closing = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                closing = chunk.model_extra.get("kvrag_receipt") or closing
        return text, closing

    async def abandoned(aclient: openai.AsyncOpenAI) -> None:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write at length."}], max_tokens=400, stream=True,
            extra_body={"kvrag": {"graft": False}})
        async for _ in stream:
            break  # the client goes away mid-stream: its row is freed at the next step
        await stream.close()

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=server_b.url, api_key="unused", max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(abandoned(aclient), *[one(aclient, i) for i in range(len(asks))])

    _, *answers = asyncio.run(run())
    for (text, closing), alone in zip(answers, expected):
        assert text == alone.text
        assert closing["first_token_logits_sha256"] == alone.receipt.first_token_logits_sha256
        assert closing["decode_tokens"] == alone.receipt.decode_tokens
    # The abandoned generation's slot is released once the server has seen its client go and the
    # generation stopped at its next token: after the other answers, not necessarily before them.
    until = time.monotonic() + 30  # a bound with a margin for a loaded 2-core machine
    while (health := httpx.get(server_b.base + "/health").json())["running"] and time.monotonic() < until:
        time.sleep(0.05)
    assert health["running"] == 0  # the abandoned generation ended too
    batch = health["batch"]
    assert batch["exact"] and batch["rows"] == 16
    assert batch["stepped_rows"] - before["stepped_rows"] > batch["forwards"] - before["forwards"]  # shared forwards


def test_a_restarted_server_finds_its_states_in_redis(server_b):
    question, document = "Who retired in 1988?", unseen(DOC_B)
    first = ask(server_b, question, [document], memo=False)
    assert receipt(first)["mode"] in READ_AS_TEXT
    server_b.stop()
    server_b.start()
    again = ask(server_b, question, [document], memo=False)
    assert receipt(again)["mode"] == "exact-graft"
    assert receipt(again)["first_token_logits_sha256"] == receipt(first)["first_token_logits_sha256"]


def test_with_redis_killed_answers_continue_by_text_and_receipts_say_why(tmp_path):
    """Its own Redis and server: killing the Redis the other tests share would make them depend on order."""
    redis_own = RedisServer(tmp_path / "redis").start()
    server = KVRagServer(MODEL, redis_own.url, log=tmp_path / "serve.log").start()
    try:
        redis_own.stop(kill=True)
        for i in range(3):
            response = ask(server, "What changed in 1904?", [f"{DOC_B} Note {i}."], memo=False)
            states = receipt(response)["states"]
            reasons = [s["reason"] for s in states if s["reason"]]
            if receipt(response)["mode"] == "text-prefill":
                assert reasons == ["unavailable"]
            else:  # a stored prefix (an earlier answer's state, kept in-process) grafted, the rest read
                assert receipt(response)["mode"] == "partial-graft" and reasons == ["missing"]
                assert all(s["tier"].startswith("memory://") for s in states if not s["reason"])
        assert httpx.get(server.base + "/health").status_code == 200
    finally:
        server.stop(kill=True)
        redis_own.stop(kill=True)


def test_sigterm_finishes_the_stream_in_flight(tmp_path):
    server = KVRagServer(MODEL, "memory://", log=tmp_path / "serve.log").start()
    try:
        with httpx.Client(timeout=120) as h:
            with h.stream("POST", server.url + "/chat/completions", json={
                    "model": MODEL, "max_tokens": 1200, "stream": True, "kvrag": {"graft": False},
                    "messages": [{"role": "user", "content": "Write at length."}]}) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                assert json.loads(first[5:])["object"] == "chat.completion.chunk"
                server.process.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        closing = json.loads(rest[-2][5:])
        assert closing["choices"][0]["finish_reason"] in ("length", "stop")
        assert closing["kvrag_receipt"]["decode_tokens"] >= 1
        assert server.process.wait(60) in (0, -signal.SIGTERM)
        assert not server.healthy()
    finally:
        server.stop(kill=True)


def test_a_started_server_has_every_worker_ready(tmp_path):
    """Workers load their models one by one behind one port; `KVRagServer.start` returns once each
    has answered `/health`, so no request right after it meets a worker still loading (a 503)."""
    server = KVRagServer(MODEL, "memory://", ("--workers", "2"), log=tmp_path / "serve.log").start()
    try:
        with httpx.Client(timeout=30) as h:
            answers = [h.get(server.base + "/health", headers={"Connection": "close"}) for _ in range(12)]
        assert [r.status_code for r in answers] == [200] * 12
        assert server.workers == 2
    finally:
        server.stop(kill=True)
