"""`KVRetriever`: what a text retriever returns, plus the key of each document's verified state."""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, PrivateAttr

from kvrag import KVEngine
from kvrag.apps import STATE_KEY, Retrieved, StateRetrieval

__all__ = ["KVRetriever", "STATE_KEY"]


class KVRetriever(BaseRetriever):
    """Wraps a LangChain retriever (or searches `documents` with kvrag's small lexical index);
    each document it returns is deposited on first sight, and carries its state key in metadata.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: KVEngine
    retriever: BaseRetriever | None = None
    documents: list[Document] | None = None
    k: int = 4
    _states: StateRetrieval | None = PrivateAttr(default=None)

    def _retrieval(self) -> StateRetrieval:
        if self._states is None:
            corpus = None if self.documents is None else [Retrieved(d.page_content, dict(d.metadata), d.id) for d in self.documents]
            self._states = StateRetrieval(self.engine, corpus)
        return self._states

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None, **kwargs: Any
    ) -> list[Document]:
        k = self.k if k is None else k
        if self.retriever is not None:
            found = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()})[:k]
            candidates = [Retrieved(d.page_content, dict(d.metadata), d.id) for d in found]
        else:
            candidates = self._retrieval().search(query, k)
        return [
            Document(page_content=r.text, metadata={**r.metadata, **({"score": r.score} if r.score is not None else {})}, id=r.id)
            for r in self._retrieval().stamp(candidates)
        ]
