"""kvrag for LlamaIndex: a retriever whose nodes carry the key of a verified KV state."""

from llama_index.retrievers.kvrag.base import STATE_KEY, KVRetriever

__all__ = ["KVRetriever", "STATE_KEY"]
