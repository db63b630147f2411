"""kvrag inside vLLM: a KV connector (`KVRagConnector`) that saves vLLM's KV blocks into kvrag's
verified stores and loads them back, checked, into vLLM's paged cache."""

from vllm_kvrag.connector import KVRagConnector, KVRagMetadata
from vllm_kvrag.settings import ConnectorSettings, block_engine, namespace_of

__all__ = ["KVRagConnector", "KVRagMetadata", "ConnectorSettings", "block_engine", "namespace_of"]
