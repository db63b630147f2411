"""`KVRagLLM`, `KVSynthesizer` and `KVQueryEngine`."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator, Generator, Sequence

from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen, LLMMetadata
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle
from pydantic import ConfigDict, Field

from kvrag import KVEngine, StateRef
from kvrag.frameworks import RECEIPT_KEY, STATE_KEY, states_for
from llama_index.retrievers.kvrag import KVRetriever

__all__ = ["KVRagLLM", "KVSynthesizer", "KVQueryEngine"]


class KVRagLLM(CustomLLM):
    """A LlamaIndex LLM over a `KVEngine`. `complete(prompt)` answers the prompt as the question;
    `complete(prompt, states=[...])` grafts those documents' states first. Decoding is greedy unless
    `temperature` > 0 (then `top_p`, `top_k` and `seed` apply)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: KVEngine = Field(exclude=True)
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def sampling_options(self, kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """This LLM's sampling settings, each overridden by `kwargs` where given."""
        kwargs = kwargs or {}
        return {name: kwargs.get(name, getattr(self, name)) for name in ("temperature", "top_p", "top_k", "seed")}

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.engine.model.max_positions,
            num_output=self.max_new_tokens,
            model_name=self.engine.model.name,
            is_chat_model=False,
        )

    def _receipt_kwargs(self, stream: Any) -> dict[str, Any]:
        return {RECEIPT_KEY: stream.generation.receipt.model_dump(mode="json")}

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        stream = self.engine.stream(prompt, states=kwargs.get("states"), max_new_tokens=self.max_new_tokens,
                                    **self.sampling_options(kwargs))
        return CompletionResponse(text=stream.result().text, additional_kwargs=self._receipt_kwargs(stream))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        stream = self.engine.stream(prompt, states=kwargs.get("states"), max_new_tokens=self.max_new_tokens,
                                    **self.sampling_options(kwargs))

        def gen() -> CompletionResponseGen:
            text = ""
            for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
            yield CompletionResponse(text=stream.generation.text, delta="", additional_kwargs=self._receipt_kwargs(stream))

        return gen()


def _states(engine: KVEngine, nodes: Sequence[NodeWithScore]) -> list[StateRef | str]:
    return states_for(engine, [(n.node.get_content(MetadataMode.NONE), n.node.metadata.get(STATE_KEY)) for n in nodes])


class KVSynthesizer(BaseSynthesizer):
    """A response synthesizer for `RetrieverQueryEngine` that grafts the nodes' states; the
    receipt is in `response.metadata["kvrag_receipt"]`. Sync, async and streaming."""

    def __init__(self, llm: KVRagLLM, streaming: bool = False) -> None:
        super().__init__(llm=llm, streaming=streaming)
        self._kv_llm = llm

    def _get_prompts(self) -> dict[str, Any]:
        return {}

    def _update_prompts(self, prompts: Any) -> None:
        return None

    def _stream(self, query: str, states: Sequence[StateRef | str]) -> Any:
        return self._kv_llm.engine.stream(query, states=states, max_new_tokens=self._kv_llm.max_new_tokens,
                                          deposit_missing=True, **self._kv_llm.sampling_options())

    def get_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> str:
        """Strings only (LlamaIndex's own path): states are still found by content where stored."""
        return self._stream(query_str, list(text_chunks)).result().text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> str:
        return await asyncio.to_thread(self.get_response, query_str, text_chunks)

    def synthesize(self, query: Any, nodes: list[NodeWithScore], additional_source_nodes: Sequence[NodeWithScore] | None = None, **kwargs: Any) -> Any:
        query_str = query.query_str if isinstance(query, QueryBundle) else str(query)
        sources = list(nodes) + list(additional_source_nodes or [])
        stream = self._stream(query_str, _states(self._kv_llm.engine, nodes))
        metadata: dict[str, Any] = {}
        if self._streaming:
            def gen() -> Generator[str, None, None]:
                yield from stream
                metadata[RECEIPT_KEY] = stream.generation.receipt.model_dump(mode="json")

            return StreamingResponse(response_gen=gen(), source_nodes=sources, metadata=metadata)
        generation = stream.result()
        metadata[RECEIPT_KEY] = generation.receipt.model_dump(mode="json")
        return Response(response=generation.text, source_nodes=sources, metadata=metadata)

    async def asynthesize(self, query: Any, nodes: list[NodeWithScore], additional_source_nodes: Sequence[NodeWithScore] | None = None, **kwargs: Any) -> Any:
        if not self._streaming:
            return await asyncio.to_thread(self.synthesize, query, nodes, additional_source_nodes)
        query_str = query.query_str if isinstance(query, QueryBundle) else str(query)
        stream = self._stream(query_str, _states(self._kv_llm.engine, nodes))
        metadata: dict[str, Any] = {}
        done = object()

        async def agen() -> AsyncGenerator[str, None]:
            iterator = iter(stream)
            while (delta := await asyncio.to_thread(next, iterator, done)) is not done:
                yield delta  # type: ignore[misc]
            metadata[RECEIPT_KEY] = stream.generation.receipt.model_dump(mode="json")

        return AsyncStreamingResponse(response_gen=agen(), source_nodes=list(nodes) + list(additional_source_nodes or []), metadata=metadata)


class KVQueryEngine(RetrieverQueryEngine):
    """`RetrieverQueryEngine` with a `KVRetriever` and a `KVSynthesizer`: the one-line swap."""

    @classmethod
    def from_engine(
        cls,
        engine: KVEngine,
        *,
        nodes: Sequence[BaseNode] | None = None,
        texts: Sequence[str] | None = None,
        retriever: BaseRetriever | None = None,
        similarity_top_k: int = 1,
        streaming: bool = False,
        max_new_tokens: int = 64,
    ) -> "KVQueryEngine":
        kv_retriever = KVRetriever.from_defaults(engine, nodes=nodes, texts=texts, retriever=retriever, similarity_top_k=similarity_top_k)
        llm = KVRagLLM(engine=engine, max_new_tokens=max_new_tokens)
        return cls(retriever=kv_retriever, response_synthesizer=KVSynthesizer(llm, streaming=streaming))
