"""`KVRetriever`: nodes as a text retriever returns them, each with its state key in metadata."""

from __future__ import annotations

import asyncio
from typing import Sequence

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle, TextNode

from kvrag import KVEngine
from kvrag.apps import STATE_KEY, STATE_METADATA_KEYS, Retrieved, StateRetrieval

__all__ = ["KVRetriever", "STATE_KEY"]


class KVRetriever(BaseRetriever):
    """Wraps a LlamaIndex retriever (or searches `nodes` with kvrag's small lexical index); each
    node is deposited on first sight and returned with its state key in metadata (hidden from the
    LLM and the embeddings)."""

    def __init__(
        self,
        engine: KVEngine,
        *,
        retriever: BaseRetriever | None = None,
        nodes: Sequence[BaseNode] | None = None,
        similarity_top_k: int = 2,
        callback_manager: CallbackManager | None = None,
    ) -> None:
        if retriever is None and nodes is None:
            raise ValueError("KVRetriever needs a retriever to wrap or nodes to search")
        self._retriever = retriever
        corpus = None if nodes is None else [_retrieved(n) for n in nodes]
        self._states = StateRetrieval(engine, corpus)
        self._top_k = similarity_top_k
        super().__init__(callback_manager=callback_manager)

    @classmethod
    def from_defaults(
        cls,
        engine: KVEngine,
        *,
        nodes: Sequence[BaseNode] | None = None,
        texts: Sequence[str] | None = None,
        retriever: BaseRetriever | None = None,
        similarity_top_k: int = 2,
    ) -> "KVRetriever":
        if texts is not None:
            nodes = [*(nodes or []), *(TextNode(text=t) for t in texts)]
        return cls(engine, retriever=retriever, nodes=nodes, similarity_top_k=similarity_top_k)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if self._retriever is not None:
            found = self._retriever.retrieve(query_bundle)[: self._top_k]
            candidates = [_retrieved(n.node, n.score) for n in found]
        else:
            candidates = self._states.search(query_bundle.query_str, self._top_k)
        hidden = list(STATE_METADATA_KEYS)
        return [
            NodeWithScore(
                node=TextNode(id_=r.id, text=r.text, metadata=r.metadata,
                              excluded_llm_metadata_keys=hidden, excluded_embed_metadata_keys=hidden),
                score=r.score,
            )
            for r in self._states.stamp(candidates)
        ]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        # Deposits run the model: off the event loop, on a worker thread.
        return await asyncio.to_thread(self._retrieve, query_bundle)


def _retrieved(node: BaseNode, score: float | None = None) -> Retrieved:
    return Retrieved(node.get_content(MetadataMode.NONE), dict(node.metadata), node.node_id, score)
