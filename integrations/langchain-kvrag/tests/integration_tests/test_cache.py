"""langchain-tests' cache suites on kvrag's stores: a real throwaway Redis, and the disk tier."""

from __future__ import annotations

import pytest
from langchain_kvrag import KVCache
from langchain_tests.integration_tests import AsyncCacheTestSuite, SyncCacheTestSuite


class TestKVCacheRedisSync(SyncCacheTestSuite):
    @pytest.fixture
    def cache(self, redis_server) -> KVCache:
        return KVCache(redis_server.url)


class TestKVCacheRedisAsync(AsyncCacheTestSuite):
    @pytest.fixture
    async def cache(self, redis_server) -> KVCache:
        return KVCache(redis_server.url)


class TestKVCacheDiskSync(SyncCacheTestSuite):
    @pytest.fixture
    def cache(self, tmp_path) -> KVCache:
        return KVCache(f"disk://{tmp_path}")


class TestKVCacheTieredAsync(AsyncCacheTestSuite):
    @pytest.fixture
    async def cache(self, redis_server, tmp_path) -> KVCache:
        return KVCache(f"{redis_server.url},disk://{tmp_path}")


def test_the_cache_serves_a_chat_model(tmp_path):
    from langchain_core.globals import set_llm_cache
    from langchain_kvrag import ChatKVRAG

    from kvrag import KVEngine, MemoryStore

    from ..conftest import tiny

    set_llm_cache(KVCache(f"disk://{tmp_path}"))
    try:
        engine = KVEngine(tiny("llama"), MemoryStore())
        forwards: list[int] = []  # every model forward the engine makes, counted where it makes them
        forward = engine.runner.forward
        engine.runner.forward = lambda ids, cache: (forwards.append(len(ids)), forward(ids, cache))[1]
        llm = ChatKVRAG(engine=engine, max_tokens=4)
        first = llm.invoke("Hello")
        assert forwards
        forwards.clear()
        second = llm.invoke("Hello")
        # A hit returns the stored generation (the receipt of the first run, timings to the last bit)
        # and runs nothing.
        assert forwards == []
        assert second.content == first.content
        assert second.response_metadata["kvrag_receipt"] == first.response_metadata["kvrag_receipt"]
        llm.invoke("Hello there")  # a miss runs the model
        assert forwards
        assert len(list(KVCache(f"disk://{tmp_path}").store.blob_names("lc-cache"))) == 2
    finally:
        set_llm_cache(None)
