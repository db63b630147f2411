"""kvrag for LlamaIndex: an LLM over `KVEngine`, and the synthesizer and query engine that hand it
the retrieved nodes' states (LlamaIndex's own synthesizers pass only strings to `complete`)."""

from llama_index.llms.kvrag.base import KVQueryEngine, KVRagLLM, KVSynthesizer

__all__ = ["KVRagLLM", "KVSynthesizer", "KVQueryEngine"]
