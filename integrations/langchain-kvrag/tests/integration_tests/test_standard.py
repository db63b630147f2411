"""langchain-tests' standard suites, offline: the retriever and the chat model on real models."""

from __future__ import annotations

from functools import lru_cache

from langchain_core.documents import Document
from langchain_kvrag import ChatKVRAG, KVRetriever
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from kvrag import KVEngine, MemoryStore, load_model
from kvrag.data import sample_docs


@lru_cache(maxsize=None)
def engine(model: str = "tiny-random-llama") -> KVEngine:
    return KVEngine(load_model(model), MemoryStore())


def documents() -> list[Document]:
    return [Document(page_content=d.text[:400], metadata={"title": d.title}, id=d.id) for d in sample_docs()]


class TestKVRetrieverStandard(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[KVRetriever]:
        return KVRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"engine": engine(), "documents": documents(), "k": 2}

    @property
    def retriever_query_example(self) -> str:
        return "Who built the lighthouse?"


class TestChatKVRAGUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatKVRAG]:
        return ChatKVRAG

    @property
    def chat_model_params(self) -> dict:
        return {"engine": engine()}


class TestChatKVRAGIntegration(ChatModelIntegrationTests):
    """The tiny model for breadth; the real model runs the chain tests in test_chains.py."""

    @property
    def chat_model_class(self) -> type[ChatKVRAG]:
        return ChatKVRAG

    @property
    def chat_model_params(self) -> dict:
        return {"engine": engine(), "max_tokens": 12}

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False


class TestChatKVRAGIntegrationSmolLM2(TestChatKVRAGIntegration):
    """The same suite once on smollm2-135m, by name (the engine is built on first use)."""

    @property
    def chat_model_params(self) -> dict:
        return {"model": "smollm2-135m", "store": "memory://", "max_tokens": 12}
