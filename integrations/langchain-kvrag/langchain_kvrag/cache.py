"""`KVCache`: LangChain's LLM cache on kvrag's stores (plain GET/SET; no Redis modules needed)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any, Sequence

from langchain_core.caches import RETURN_VAL_TYPE, BaseCache
from langchain_core.load import dumps, loads
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, Generation, GenerationChunk

from kvrag.errors import StoreError
from kvrag.stores import DEFAULT_DEADLINE_S, Deadline, StateStore, open_store
from kvrag.trust import SealedRecords, key_for

__all__ = ["KVCache"]

log = logging.getLogger("langchain_kvrag.cache")

NAMESPACE = "lc-cache"
# A shared store is a trust boundary: only generation and message classes are ever rebuilt.
_ALLOWED = [Generation, ChatGeneration, AIMessage, AIMessageChunk, GenerationChunk, ChatGenerationChunk]


class KVCache(BaseCache):
    """`set_llm_cache(KVCache("redis://127.0.0.1:6379/0"))`: one blob per (prompt, llm string).

    Entries are LangChain's own serialization of the generations (JSON, never pickle), sealed with
    the signing key (see `kvrag.trust.signing`) and bound to their slot: an entry rewritten or moved by
    someone without the key is a miss. A store that fails is a miss on read and a logged warning on
    write; it never fails the call the cache sits behind.
    """

    def __init__(self, store: StateStore | str | None = None, *, ttl: int | None = None,
                 signing_key: bytes | str | None = None, allow_unsigned: bool = False,
                 deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        self.store = store if isinstance(store, StateStore) else open_store(store)
        self.ttl = ttl
        self.deadline_s = deadline_s  # the most a lookup waits on the store: then it is a miss
        key, _ = key_for(signing_key, self.store.namespace)  # a tenant's, for a namespace
        self._records = SealedRecords(self.store, key, allow_unsigned=allow_unsigned)  # type: ignore[arg-type]

    @staticmethod
    def _name(prompt: str, llm_string: str) -> str:
        digest = hashlib.sha256(prompt.encode() + b"\x00" + llm_string.encode()).hexdigest()
        return f"{NAMESPACE}/{digest}"

    def lookup(self, prompt: str, llm_string: str) -> RETURN_VAL_TYPE | None:
        raw = self._records.get(self._name(prompt, llm_string), Deadline(self.deadline_s))
        if raw is None:
            return None
        try:
            return loads(raw.decode(), allowed_objects=_ALLOWED)
        except Exception as e:  # noqa: BLE001 - whatever an unreadable entry raises, it is a miss
            log.warning("unreadable cache entry: %s", str(e)[:200])
            return None

    def update(self, prompt: str, llm_string: str, return_val: RETURN_VAL_TYPE) -> None:
        try:
            self._records.put(self._name(prompt, llm_string), dumps(list(return_val)).encode(), ttl=self.ttl)
        except StoreError as e:
            log.warning("could not write a cache entry: %s", e)

    def clear(self, **kwargs: Any) -> None:
        for name in list(self.store.blob_names(NAMESPACE)):
            self.store.delete_blob(name)

    async def alookup(self, prompt: str, llm_string: str) -> RETURN_VAL_TYPE | None:
        return await asyncio.to_thread(self.lookup, prompt, llm_string)

    async def aupdate(self, prompt: str, llm_string: str, return_val: Sequence[Any]) -> None:
        await asyncio.to_thread(self.update, prompt, llm_string, return_val)  # type: ignore[arg-type]

    async def aclear(self, **kwargs: Any) -> None:
        await asyncio.to_thread(self.clear)
