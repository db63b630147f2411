"""LlamaIndex pipelines on kvrag (LlamaIndex ships no standard suite): retriever, LLM, synthesizer and
query engine inside `RetrieverQueryEngine`, sync, async and streaming, with receipts that show the graft."""

from __future__ import annotations

import pytest
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import TextNode
from llama_index.llms.kvrag import KVQueryEngine, KVRagLLM, KVSynthesizer
from llama_index.retrievers.kvrag import STATE_KEY, KVRetriever

from kvrag import KVEngine, MemoryStore, load_model
from kvrag.data import sample_docs

from ..conftest import load_example, tiny

QUESTION = "Who built the lighthouse at Varrow Point?"


@pytest.fixture
def nodes():
    return [TextNode(id_=d.id, text=d.text, metadata={"title": d.title}) for d in sample_docs()]


@pytest.fixture
def tiny_engine():
    return KVEngine(tiny("llama"), MemoryStore())


def test_llm_complete_and_stream_complete(tiny_engine):
    llm = KVRagLLM(engine=tiny_engine, max_new_tokens=6)
    ref = tiny_engine.deposit("Paris is the capital of France.")
    whole = llm.complete("What is the capital?", states=[ref])
    assert whole.additional_kwargs["kvrag_receipt"]["mode"] == "exact-graft"
    pieces = list(llm.stream_complete("What is the capital?", states=[ref]))
    assert pieces[-1].text == whole.text and pieces[-1].additional_kwargs["kvrag_receipt"]["mode"] == "exact-graft"
    assert llm.metadata.model_name == "tiny-random-llama" and llm.metadata.context_window == 4096


def test_inside_retriever_query_engine_sync_async_and_streaming(tiny_engine, nodes):
    import asyncio

    retriever = KVRetriever.from_defaults(tiny_engine, nodes=nodes, similarity_top_k=1)
    llm = KVRagLLM(engine=tiny_engine, max_new_tokens=6)
    engine = RetrieverQueryEngine(retriever=retriever, response_synthesizer=KVSynthesizer(llm))
    sync = engine.query(QUESTION)
    assert sync.metadata["kvrag_receipt"]["mode"] == "exact-graft"
    assert sync.source_nodes[0].node.metadata[STATE_KEY] == sync.metadata["kvrag_receipt"]["states"][0]["key"]
    async_response = asyncio.run(engine.aquery(QUESTION))
    assert str(async_response) == str(sync) and async_response.metadata["kvrag_receipt"]["mode"] == "exact-graft"

    streaming = RetrieverQueryEngine(retriever=retriever, response_synthesizer=KVSynthesizer(llm, streaming=True))
    streamed = streaming.query(QUESTION)
    assert "".join(streamed.response_gen).strip() == str(sync)
    assert streamed.metadata["kvrag_receipt"]["mode"] == "exact-graft"

    async def astream() -> tuple[str, dict]:
        response = await streaming.aquery(QUESTION)
        text = "".join([delta async for delta in response.async_response_gen()])
        return text, response.metadata

    text, metadata = asyncio.run(astream())
    assert text.strip() == str(sync) and metadata["kvrag_receipt"]["mode"] == "exact-graft"


def test_a_plain_llm_swap_grafts_from_the_second_ask_and_says_so(tiny_engine, nodes):
    from llama_index.core import get_response_synthesizer
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent

    receipts = []

    class Receipts(BaseEventHandler):
        def handle(self, event, **kwargs):
            if isinstance(event, LLMChatEndEvent):
                receipts.append(event.response.additional_kwargs["kvrag_receipt"])

    handler = Receipts()
    get_dispatcher().add_event_handler(handler)
    try:
        retriever = KVRetriever.from_defaults(tiny_engine, nodes=nodes, similarity_top_k=1)
        llm = KVRagLLM(engine=tiny_engine, max_new_tokens=4)
        engine = RetrieverQueryEngine(retriever=retriever, response_synthesizer=get_response_synthesizer(llm=llm))
        first = engine.query(QUESTION)
        second = engine.query(QUESTION)
    finally:
        get_dispatcher().event_handlers.remove(handler)
    # LlamaIndex's own synthesizer hands the LLM a formatted prompt: read as text first, grafted after.
    assert [r["mode"] for r in receipts] == ["text-prefill", "exact-graft"]
    assert receipts[1]["first_token_logits_sha256"] == receipts[0]["first_token_logits_sha256"]
    assert str(first) == str(second)


@pytest.mark.slow
def test_the_example_query_engine_grafts_and_matches_plain_text():
    rows = load_example("llamaindex_rag").main(questions=6)
    assert len(rows) == 6
    for row in rows:
        assert row["mode"] == "exact-graft" and row["text_mode"] == "text-prefill"
        assert row["answer"] == row["text_answer"]


@pytest.mark.slow
def test_fallback_for_another_models_state_and_a_missing_state(smollm2, nodes):
    other = KVEngine(load_model("smollm2-135m", dtype="bfloat16"), MemoryStore())
    ours = KVEngine(smollm2, MemoryStore())
    retriever = KVRetriever.from_defaults(other, nodes=nodes, similarity_top_k=1)
    llm = KVRagLLM(engine=ours, max_new_tokens=16)
    response = RetrieverQueryEngine(retriever=retriever, response_synthesizer=KVSynthesizer(llm)).query(QUESTION)
    assert response.metadata["kvrag_receipt"]["mode"] == "text-prefill" and "Quill" in str(response)

    query_engine = KVQueryEngine.from_engine(ours, nodes=nodes, max_new_tokens=16)
    first = query_engine.query(QUESTION)
    assert first.metadata["kvrag_receipt"]["mode"] == "exact-graft"
    ours.store.delete(first.source_nodes[0].node.metadata[STATE_KEY])
    retriever = query_engine.retriever
    nodes_found = retriever.retrieve(QUESTION)  # re-deposits on sight...
    ours.store.delete(nodes_found[0].node.metadata[STATE_KEY])  # ...so remove it again before answering
    response = KVSynthesizer(llm).synthesize(QUESTION, nodes_found)
    assert response.metadata["kvrag_receipt"]["mode"] == "text-prefill"
    assert str(response) == str(first)
