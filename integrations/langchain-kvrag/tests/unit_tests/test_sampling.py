"""Sampling settings reach the engine through `ChatKVRAG`, and show in the receipt."""

from __future__ import annotations

from langchain_kvrag import ChatKVRAG

from kvrag import KVEngine, MemoryStore

from ..conftest import QUESTION, tiny

SAMPLED = dict(temperature=0.9, top_p=0.95, top_k=100, seed=77)


def test_chat_kvrag_samples_reproducibly_and_per_call():
    chat = ChatKVRAG(engine=KVEngine(tiny("llama"), MemoryStore()), max_tokens=10, **SAMPLED)
    first, again = chat.invoke(QUESTION), chat.invoke(QUESTION)
    assert first.content == again.content
    assert first.response_metadata["kvrag_receipt"]["sampling"] == SAMPLED
    greedy = chat.invoke(QUESTION, temperature=0.0)
    assert greedy.response_metadata["kvrag_receipt"]["sampling"]["temperature"] == 0.0
    assert greedy.response_metadata["kvrag_receipt"]["first_token_logits_sha256"] == \
        first.response_metadata["kvrag_receipt"]["first_token_logits_sha256"]
