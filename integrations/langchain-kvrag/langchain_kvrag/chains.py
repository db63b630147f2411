"""The common `retriever -> prompt -> llm` chain in one call, with documents kept as state blocks."""

from __future__ import annotations

from typing import Any, Sequence

from langchain_core.documents import Document
from langchain_core.messages import HumanMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough

from langchain_kvrag.retrievers import STATE_KEY

__all__ = ["state_blocks", "create_kv_rag_chain"]


def state_blocks(documents: Sequence[Document]) -> list[dict[str, Any]]:
    """Text content blocks for retrieved documents, each carrying its state key in `extras`."""
    return [
        {"type": "text", "text": d.page_content, "extras": {STATE_KEY: d.metadata.get(STATE_KEY)}}
        for d in documents
    ]


def create_kv_rag_chain(retriever: BaseRetriever, llm: Runnable) -> Runnable:
    """`question -> retriever -> [documents as state blocks, question] -> llm` (an `AIMessage`)."""

    def to_messages(inputs: dict[str, Any]) -> list[HumanMessage]:
        blocks = state_blocks(inputs["documents"]) + [{"type": "text", "text": inputs["question"]}]
        return [HumanMessage(content=blocks)]

    return (
        RunnableParallel(documents=retriever, question=RunnablePassthrough())
        | RunnableLambda(to_messages)
        | llm
    )
