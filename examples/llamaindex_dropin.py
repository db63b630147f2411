"""LlamaIndex's starter pipeline, as its tutorial writes it, with one line changed: the LLM.

    python examples/llamaindex_dropin.py

Below is LlamaIndex's starter example (documents, `VectorStoreIndex`, `as_query_engine()`). The
one change is `Settings.llm = KVRagLLM(...)`; nothing else knows about kvrag, and no OpenAI key is
needed. The default query engine formats its own prompt (its text-QA template, the retrieved
chunks, the query); kvrag renders it with the model's chat template and grafts every part already
stored as a verified state, so a second query over the same chunks grafts them. Each response's
receipt is in `additional_kwargs["kvrag_receipt"]` of the LLM's response, seen through LlamaIndex's
instrumentation events.

The tutorial's embedding model would be downloaded from a model hub; this offline example uses a
small hashed bag-of-words embedding instead (`Settings.embed_model`, also one line).
"""

from __future__ import annotations

import hashlib
import re

from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.embeddings import BaseEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.llms.kvrag import KVRagLLM

from kvrag.data import sample_docs, sample_questions


class HashingEmbedding(BaseEmbedding):
    """Words hashed into 256 buckets, normalised: an offline stand-in for a downloaded embedding."""

    def _vector(self, text: str) -> list[float]:
        vector = [0.0] * 256
        for word in re.findall(r"\w+", text.lower()):
            vector[int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "big") % 256] += 1.0
        norm = sum(v * v for v in vector) ** 0.5 or 1.0
        return [v / norm for v in vector]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vector(text)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)


class Receipts(BaseEventHandler):
    """Collects the receipt of every LLM response (LlamaIndex's instrumentation, nothing of kvrag's)."""

    receipts: list = []

    def handle(self, event, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.receipts.append(event.response.additional_kwargs.get("kvrag_receipt"))


Settings.llm = KVRagLLM(model="smollm2-135m", max_new_tokens=32)  # the one line: was OpenAI(model=...)
Settings.embed_model = HashingEmbedding()  # offline stand-in for a downloaded embedding model

documents = [Document(text=d.text, metadata={"title": d.title}, id_=d.id) for d in sample_docs()]
index = VectorStoreIndex.from_documents(documents)
query_engine = index.as_query_engine(similarity_top_k=2)


def main(questions: int = 3) -> list[dict]:
    """Each question twice through the unchanged query engine: the second grafts what the first read."""
    handler = Receipts(receipts=[])
    get_dispatcher().add_event_handler(handler)
    rows = []
    try:
        for q in sample_questions()[:questions]:
            first = str(query_engine.query(q.question))
            handler.receipts.clear()
            again = str(query_engine.query(q.question))
            receipt = handler.receipts[-1]
            rows.append({"question": q.question, "answer": first, "again": again, "mode": receipt["mode"],
                         "tokens_reused": receipt["tokens_reused"], "tokens_prefilled": receipt["tokens_prefilled"]})
            print(f"Q: {q.question}\nA: {first}\n   asked again: {receipt['mode']}, {receipt['tokens_reused']} tokens "
                  f"grafted, {receipt['tokens_prefilled']} read, same answer: {again == first}\n")
    finally:
        get_dispatcher().event_handlers.remove(handler)
    return rows


if __name__ == "__main__":
    main()
