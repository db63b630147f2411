"""`KVRagLLM`, `KVSynthesizer` and `KVQueryEngine`."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator, Generator, Iterator, Sequence

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle
from llama_index.retrievers.kvrag import KVRetriever
from pydantic import ConfigDict, Field, PrivateAttr

from kvrag import GenerationOptions, GenerationStream, KVEngine, StateRef
from kvrag.apps import RECEIPT_KEY, STATE_KEY, EngineOpener, call_options, states_for
from kvrag.core import RAG_DEFAULTS, Order

__all__ = ["KVRagLLM", "KVSynthesizer", "KVQueryEngine"]


_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool", "function": "tool",
          "developer": "system", "model": "assistant", "chatbot": "assistant"}


def _messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """LlamaIndex chat messages in kvrag's (OpenAI) shape; the text of every text block."""
    return [{"role": _ROLES.get(str(getattr(m.role, "value", m.role)), "user"), "content": m.content or ""}
            for m in messages]


class KVRagLLM(CustomLLM):
    """A LlamaIndex LLM over a `KVEngine`, for any LlamaIndex pipeline unchanged (set it as
    `llm=` or `Settings.llm`): each prompt or conversation is rendered with the model's chat
    template and every part of it already stored as a verified state is grafted (see
    `KVEngine.stream_chat`); what was read as text is deposited afterwards, so the next prompt that
    begins alike grafts it. The receipt is in every response's `additional_kwargs["kvrag_receipt"]`.

    Give `engine`, or `model` (and `store`, `signing_key_file`, `namespace`, `dtype`, `attn`) to
    build one on first use. Decoding is
    greedy unless `temperature` > 0 (then `top_p`, `top_k` and `seed` apply). `complete(prompt,
    states=[...])` instead answers `prompt` as a question after those documents' states.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    engine: KVEngine | None = Field(default=None, exclude=True)
    model: str = "smollm2-135m"
    store: str | None = None  # a store URL (kvrag.stores.open_store); default: the disk store
    signing_key_file: str | None = None  # the fleet's key file; default: kvrag's key order
    namespace: str | None = None  # a tenant: its key is derived from the signing key
    dtype: str | None = None
    attn: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    deposit_missing: bool = RAG_DEFAULTS.deposit_missing  # deposit what was read as text, after the answer
    admit_after: int = RAG_DEFAULTS.admit_after  # ...once the same chain was read as text this many times
    deposit_in_background: bool = RAG_DEFAULTS.deposit_in_background  # ...on the engine's worker, off the answer's path
    graft: bool = True  # False: read every prompt as text, in the same segments (plain text RAG)
    order: Order = RAG_DEFAULTS.order  # the order documents are read in (kvrag.GenerationOptions)
    _opener: EngineOpener = PrivateAttr(default_factory=EngineOpener)

    @classmethod
    def class_name(cls) -> str:
        return "KVRagLLM"

    def kv_engine(self) -> KVEngine:
        """The engine: the one given, or one built on first use (once, even from several threads)."""
        return self._opener.engine(self.engine, self.model, self.store, dtype=self.dtype, attn=self.attn,
                                   signing_key_file=self.signing_key_file, namespace=self.namespace)

    def options(self, kwargs: dict[str, Any] | None = None) -> GenerationOptions:
        """This LLM's options (its fields), each overridden by a call's `kwargs` where given."""
        fields = GenerationOptions(max_new_tokens=self.max_new_tokens, graft=self.graft,
                                   deposit_missing=self.deposit_missing, temperature=self.temperature,
                                   top_p=self.top_p, top_k=self.top_k, seed=self.seed, order=self.order,
                                   admit_after=self.admit_after, deposit_in_background=self.deposit_in_background)
        return call_options(fields, kwargs or {})

    @property
    def metadata(self) -> LLMMetadata:
        engine = self.kv_engine()
        return LLMMetadata(
            context_window=engine.model.max_positions,
            num_output=self.max_new_tokens,
            model_name=engine.model.name,
            is_chat_model=engine.layout.kind == "chat",  # a base model gets completion prompts
        )

    def _stream(self, messages: list[dict[str, str]], kwargs: dict[str, Any]) -> GenerationStream:
        engine = self.kv_engine()
        states = kwargs.get("states")
        if states is not None:  # documents handed over as states (KVSynthesizer's way)
            return engine.stream(messages[-1]["content"], states=states, options=self.options(kwargs))
        return engine.stream_chat(messages, options=self.options(kwargs))

    @staticmethod
    def _receipt_kwargs(stream: GenerationStream) -> dict[str, Any]:
        assert stream.generation is not None
        return {RECEIPT_KEY: stream.generation.receipt.model_dump(mode="json")}

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        stream = self._stream(_messages(messages), kwargs)
        text = stream.result().text
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                            additional_kwargs=self._receipt_kwargs(stream))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, kwargs)

    def _stream_chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponseGen:
        stream = self._stream(_messages(messages), kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            for delta in stream:
                text += delta
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
            assert stream.generation is not None
            yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=stream.generation.text),
                               delta="", additional_kwargs=self._receipt_kwargs(stream))

        return gen()

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, kwargs)

    def _prompt_stream(self, prompt: str, kwargs: dict[str, Any]) -> GenerationStream:
        """A completion prompt continued as given on a base model, as one user message on a chat
        model (`KVEngine.stream_complete`); documents handed over as states are grafted from them."""
        if kwargs.get("states") is not None:
            return self._stream([{"role": "user", "content": prompt}], kwargs)
        return self.kv_engine().stream_complete(prompt, options=self.options(kwargs))

    def _complete(self, prompt: str, kwargs: dict[str, Any]) -> CompletionResponse:
        stream = self._prompt_stream(prompt, kwargs)
        return CompletionResponse(text=stream.result().text, additional_kwargs=self._receipt_kwargs(stream))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream_complete(prompt, kwargs)

    def _stream_complete(self, prompt: str, kwargs: dict[str, Any]) -> CompletionResponseGen:
        stream = self._prompt_stream(prompt, kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
            assert stream.generation is not None
            yield CompletionResponse(text=stream.generation.text, delta="", additional_kwargs=self._receipt_kwargs(stream))

        return gen()

    # The model runs on a worker thread, so the event loop stays free while it reads and decodes.
    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await asyncio.to_thread(self._chat, messages, kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self._complete, prompt, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return _in_thread(self._stream_chat(messages, kwargs))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return _in_thread(self._stream_complete(prompt, kwargs))


async def _in_thread(items: Iterator[Any]) -> AsyncGenerator[Any, None]:
    done = object()
    while (item := await asyncio.to_thread(next, items, done)) is not done:
        yield item


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
        return self._kv_llm.kv_engine().stream(query, states=states, options=self._kv_llm.options(),
                                               deposit_missing=True)

    def get_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> str:
        """Strings only (LlamaIndex's own path): states are still found by content where stored."""
        return self._stream(query_str, list(text_chunks)).result().text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> str:
        return await asyncio.to_thread(self.get_response, query_str, text_chunks)

    def synthesize(self, query: Any, nodes: list[NodeWithScore], additional_source_nodes: Sequence[NodeWithScore] | None = None, **kwargs: Any) -> Any:
        query_str = query.query_str if isinstance(query, QueryBundle) else str(query)
        sources = list(nodes) + list(additional_source_nodes or [])
        stream = self._stream(query_str, _states(self._kv_llm.kv_engine(), nodes))
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
        stream = self._stream(query_str, _states(self._kv_llm.kv_engine(), nodes))
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
