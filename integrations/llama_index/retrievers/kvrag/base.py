"""`KVRetriever`: nodes as a text retriever returns them, each with its state key in metadata."""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle, TextNode

from kvrag import KVEngine
from kvrag.index import IndexedDoc, LexicalIndex

__all__ = ["KVRetriever", "STATE_KEY"]

#: Metadata key holding a node's state key (a JSON-safe hex string); hidden from the LLM and embeddings.
STATE_KEY = "kvrag_state_key"


class KVRetriever(BaseRetriever):
    """Wraps a LlamaIndex retriever (or searches `nodes` with kvrag's small lexical index); each
    node is deposited on first sight and returned with its state key in metadata."""

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
        self._engine = engine
        self._retriever = retriever
        self._nodes = list(nodes or [])
        self._index = None if retriever is not None else LexicalIndex(
            [IndexedDoc(n.get_content(MetadataMode.NONE), dict(n.metadata), n.node_id) for n in self._nodes]
        )
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

    def _candidates(self, query_bundle: QueryBundle) -> list[tuple[str, dict[str, Any], str | None, float | None]]:
        if self._retriever is not None:
            found = self._retriever.retrieve(query_bundle)[: self._top_k]
            return [(n.node.get_content(MetadataMode.NONE), dict(n.node.metadata), n.node.node_id, n.score) for n in found]
        assert self._index is not None
        return [(d.text, dict(d.metadata), d.id, score) for d, score in self._index.search(query_bundle.query_str, self._top_k)]

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        results = []
        for text, metadata, node_id, score in self._candidates(query_bundle):
            ref = self._engine.ensure(text)
            hidden = [STATE_KEY, "kvrag_model_fingerprint"]
            node = TextNode(
                id_=node_id or ref.key,
                text=text,
                metadata={**metadata, STATE_KEY: ref.key, "kvrag_model_fingerprint": ref.model_fingerprint},
                excluded_llm_metadata_keys=hidden,
                excluded_embed_metadata_keys=hidden,
            )
            results.append(NodeWithScore(node=node, score=score))
        return results

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        # Deposits run the model: off the event loop, on a worker thread.
        return await asyncio.to_thread(self._retrieve, query_bundle)
