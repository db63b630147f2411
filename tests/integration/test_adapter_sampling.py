"""Sampling settings reach the engine through both frameworks' LLM classes, and show in the receipt."""

from __future__ import annotations

from kvrag import KVEngine, MemoryStore

from ..conftest import QUESTION, tiny

SAMPLED = dict(temperature=0.9, top_p=0.95, top_k=100, seed=77)


def test_chat_kvrag_samples_reproducibly_and_per_call():
    from langchain_kvrag import ChatKVRAG

    chat = ChatKVRAG(engine=KVEngine(tiny("llama"), MemoryStore()), max_tokens=10, **SAMPLED)
    first, again = chat.invoke(QUESTION), chat.invoke(QUESTION)
    assert first.content == again.content
    assert first.response_metadata["kvrag_receipt"]["sampling"] == SAMPLED
    greedy = chat.invoke(QUESTION, temperature=0.0)
    assert greedy.response_metadata["kvrag_receipt"]["sampling"]["temperature"] == 0.0
    assert greedy.response_metadata["kvrag_receipt"]["first_token_logits_sha256"] == \
        first.response_metadata["kvrag_receipt"]["first_token_logits_sha256"]


def test_kvrag_llm_samples_reproducibly():
    from llama_index.llms.kvrag import KVRagLLM

    llm = KVRagLLM(engine=KVEngine(tiny("llama"), MemoryStore()), max_new_tokens=10, **SAMPLED)
    first, again = llm.complete(QUESTION), llm.complete(QUESTION)
    assert first.text == again.text and first.additional_kwargs["kvrag_receipt"]["sampling"] == SAMPLED
    other = llm.complete(QUESTION, seed=78)
    assert other.additional_kwargs["kvrag_receipt"]["sampling"]["seed"] == 78
