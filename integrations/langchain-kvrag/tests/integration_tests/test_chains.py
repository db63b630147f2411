"""LangChain pipelines on kvrag with the real model: grafts once deposited, text when not."""

from __future__ import annotations

import json

import pytest
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage
from langchain_kvrag import STATE_KEY, ChatKVRAG, KVRetriever, create_kv_rag_chain, state_blocks

from kvrag import KVEngine, MemoryStore, load_model
from kvrag.apps import FINGERPRINT_KEY
from kvrag.data import sample_docs

from ..conftest import load_example

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def docs():
    return [Document(page_content=d.text, metadata={"title": d.title}, id=d.id) for d in sample_docs()]


def test_the_example_chain_grafts_and_matches_plain_text():
    rows = load_example("langchain_rag").main(questions=6)
    assert len(rows) == 6
    for row in rows:
        assert row["mode"] == "exact-graft" and row["text_mode"] == "text-prefill"
        assert row["answer"] == row["text_answer"]


def test_retrieved_metadata_is_json_safe_and_ids_deterministic(smollm2, docs):
    engine = KVEngine(smollm2, MemoryStore())
    retriever = KVRetriever(engine=engine, documents=docs, k=2)
    first = retriever.invoke("Who wound the Ashgrove clock?")
    assert first[0].metadata["title"] == "The Ashgrove Town Clock"
    json.dumps([d.metadata for d in first])
    assert all(len(d.metadata[STATE_KEY]) == 64 for d in first)
    assert [d.id for d in first] == [d.id for d in retriever.invoke("Who wound the Ashgrove clock?")]
    assert len(retriever.invoke("Who wound the Ashgrove clock?", k=1)) == 1


def test_wrapping_another_retriever_and_k_greater_than_one(smollm2, docs):
    engine = KVEngine(smollm2, MemoryStore())
    inner = KVRetriever(engine=KVEngine(smollm2, MemoryStore()), documents=docs, k=2)  # any BaseRetriever
    chain = create_kv_rag_chain(KVRetriever(engine=engine, retriever=inner, k=2), ChatKVRAG(engine=engine, max_tokens=12))
    first = chain.invoke("Who chairs the Kelpfield council?").response_metadata["kvrag_receipt"]
    assert first["mode"] == "partial-graft"  # the second document's state was deposited at the start
    assert first["states"][1]["reason"] == "moved"
    second = chain.invoke("Who chairs the Kelpfield council?").response_metadata["kvrag_receipt"]
    assert second["mode"] == "exact-graft"  # the chain was deposited after the first answer
    assert second["first_token_logits_sha256"] == first["first_token_logits_sha256"]


def test_fallback_for_another_models_state_and_for_a_missing_state(smollm2, docs):
    other = KVEngine(load_model("smollm2-135m", dtype="bfloat16"), MemoryStore())  # another fingerprint
    retriever = KVRetriever(engine=other, documents=docs, k=1)
    ours = KVEngine(smollm2, MemoryStore())
    llm = ChatKVRAG(engine=ours, max_tokens=16, deposit_missing=False)
    # the retriever stamps the other engine's state: its key and fingerprint, not ours
    stamped = retriever.invoke("Who built the lighthouse at Varrow Point?")[0]
    assert stamped.metadata[STATE_KEY] == other.ref(stamped.page_content).key != ours.ref(stamped.page_content).key
    assert stamped.metadata[FINGERPRINT_KEY] == other.fingerprint != ours.fingerprint
    chain = create_kv_rag_chain(retriever, llm)
    answer = chain.invoke("Who built the lighthouse at Varrow Point?")
    receipt = answer.response_metadata["kvrag_receipt"]
    # ours never holds a state for it: the stamped key is not ours, so the text is read
    assert receipt["mode"] == "text-prefill" and receipt["states"][0]["reason"] == "missing"
    assert receipt["states"][0]["key"] != stamped.metadata[STATE_KEY]
    assert "Quill" in answer.text

    retriever = KVRetriever(engine=ours, documents=docs, k=1)
    found = retriever.invoke("Who built the lighthouse at Varrow Point?")
    ours.store.delete(found[0].metadata[STATE_KEY])
    message = HumanMessage(content=state_blocks(found) + [{"type": "text", "text": "Who built the lighthouse at Varrow Point?"}])
    answer = llm.invoke([message])
    assert answer.response_metadata["kvrag_receipt"]["mode"] == "text-prefill"
    assert {s["reason"] for s in answer.response_metadata["kvrag_receipt"]["states"] if s["source"] == "text"} == {"missing"}
    assert answer.text and answer.response_metadata["model_provider"] == "kvrag"


def test_streaming_carries_usage_and_the_receipt_on_the_last_chunk(smollm2, docs):
    engine = KVEngine(smollm2, MemoryStore())
    chain = create_kv_rag_chain(KVRetriever(engine=engine, documents=docs, k=1), ChatKVRAG(engine=engine, max_tokens=16))
    chunks = list(chain.stream("What colour is Lindholm glass?"))
    assert len(chunks) > 2 and chunks[-1].chunk_position == "last"
    assert chunks[-1].usage_metadata["output_tokens"] > 0
    assert chunks[-1].response_metadata["kvrag_receipt"]["mode"] == "exact-graft"
    assert "".join(c.text for c in chunks) == chain.invoke("What colour is Lindholm glass?").text
    params = ChatKVRAG(engine=engine)._identifying_params
    assert params["model_fingerprint"] == engine.fingerprint
