"""Sampling settings reach the engine through `KVRagLLM`, and show in the receipt."""

from __future__ import annotations

from llama_index.llms.kvrag import KVRagLLM

from kvrag import KVEngine, MemoryStore

from ..conftest import QUESTION, tiny

SAMPLED = dict(temperature=0.9, top_p=0.95, top_k=100, seed=77)


def test_kvrag_llm_samples_reproducibly():
    llm = KVRagLLM(engine=KVEngine(tiny("llama"), MemoryStore()), max_new_tokens=10, **SAMPLED)
    first, again = llm.complete(QUESTION), llm.complete(QUESTION)
    assert first.text == again.text and first.additional_kwargs["kvrag_receipt"]["sampling"] == SAMPLED
    other = llm.complete(QUESTION, seed=78)
    assert other.additional_kwargs["kvrag_receipt"]["sampling"]["seed"] == 78
