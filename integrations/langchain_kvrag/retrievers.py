"""`KVRetriever`: what a text retriever returns, plus the key of each document's verified state."""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, PrivateAttr

from kvrag import KVEngine
from kvrag.index import IndexedDoc, LexicalIndex

__all__ = ["KVRetriever", "STATE_KEY"]

#: Metadata key holding a document's state key (a JSON-safe hex string, never a live object).
STATE_KEY = "kvrag_state_key"


class KVRetriever(BaseRetriever):
    """Wraps a LangChain retriever (or searches `documents` with kvrag's small lexical index);
    each document it returns is deposited on first sight, and carries its state key in metadata.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: KVEngine
    retriever: BaseRetriever | None = None
    documents: list[Document] | None = None
    k: int = 4
    _index: LexicalIndex | None = PrivateAttr(default=None)

    def _search(self, query: str, k: int, run_manager: CallbackManagerForRetrieverRun) -> list[tuple[Document, float | None]]:
        if self.retriever is not None:
            found = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()})
            return [(d, None) for d in found[:k]]
        if self.documents is None:
            raise ValueError("KVRetriever needs a retriever to wrap or documents to search")
        if self._index is None:
            self._index = LexicalIndex([IndexedDoc(d.page_content, dict(d.metadata), d.id) for d in self.documents])
        return [(Document(page_content=d.text, metadata=dict(d.metadata), id=d.id), score) for d, score in self._index.search(query, k)]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None, **kwargs: Any
    ) -> list[Document]:
        results = []
        for doc, score in self._search(query, self.k if k is None else k, run_manager):
            ref = self.engine.ensure(doc.page_content)
            metadata = {**doc.metadata, STATE_KEY: ref.key, "kvrag_model_fingerprint": ref.model_fingerprint}
            if score is not None:
                metadata["score"] = score
            results.append(Document(page_content=doc.page_content, metadata=metadata, id=doc.id or ref.key))
        return results
