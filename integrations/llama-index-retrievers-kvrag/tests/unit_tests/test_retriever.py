"""The LlamaIndex retriever: nodes carry their state keys as hidden, JSON-safe metadata."""

from __future__ import annotations

import json

import pytest
from llama_index.core.schema import MetadataMode, QueryBundle, TextNode
from llama_index.retrievers.kvrag import STATE_KEY, KVRetriever

from kvrag import KVEngine, MemoryStore
from kvrag.data import sample_docs

from ..conftest import tiny

QUESTION = "Who built the lighthouse at Varrow Point?"


@pytest.fixture
def nodes():
    return [TextNode(id_=d.id, text=d.text, metadata={"title": d.title}) for d in sample_docs()]


@pytest.fixture
def tiny_engine():
    return KVEngine(tiny("llama"), MemoryStore())


def test_retriever_nodes_carry_hidden_json_safe_state_keys(tiny_engine, nodes):
    retriever = KVRetriever.from_defaults(tiny_engine, nodes=nodes, similarity_top_k=2)
    found = retriever.retrieve(QUESTION)
    assert len(found) == 2 and found[0].node.node_id == "varrow-lighthouse"
    node = found[0].node
    assert len(node.metadata[STATE_KEY]) == 64 and tiny_engine.holds(tiny_engine.ref(node.text))
    assert STATE_KEY not in node.get_content(MetadataMode.LLM) and STATE_KEY not in node.get_content(MetadataMode.EMBED)
    json.dumps(node.metadata)
    wrapped = KVRetriever.from_defaults(KVEngine(tiny("llama"), MemoryStore()), retriever=retriever, similarity_top_k=1)
    assert [n.node.node_id for n in wrapped.retrieve(QUESTION)] == ["varrow-lighthouse"]


async def test_async_retrieval(tiny_engine, nodes):
    retriever = KVRetriever.from_defaults(tiny_engine, nodes=nodes, similarity_top_k=1)
    found = await retriever.aretrieve(QueryBundle(QUESTION))
    assert found[0].node.metadata[STATE_KEY] == retriever.retrieve(QUESTION)[0].node.metadata[STATE_KEY]
