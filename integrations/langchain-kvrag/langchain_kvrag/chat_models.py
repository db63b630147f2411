"""`ChatKVRAG`: a LangChain chat model that grafts the states of the documents it is handed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict

from kvrag import Generation
from kvrag.apps import RECEIPT_KEY, STATE_KEY, states_for
from langchain_kvrag.engine_fields import KVEngineFields

__all__ = ["ChatKVRAG"]


_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "tool",
          "developer": "system"}


def _conversation(messages: list[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages in kvrag's (OpenAI) shape: each message's text (its text blocks joined)."""
    converted = []
    for message in messages:
        role = message.role if isinstance(message, ChatMessage) else message.type
        converted.append({"role": _ROLES.get(role, role if role in ("user", "assistant") else "user"),
                          "content": str(message.text)})
    return converted


def _split(messages: list[BaseMessage]) -> tuple[list[tuple[str, str]], str]:
    """Documents (text blocks that carry a state key) as (text, key), in order; the rest is the question."""
    documents: list[tuple[str, str]] = []
    turns: list[tuple[str, str]] = []
    for message in messages:
        parts: list[str] = []
        content = message.content if isinstance(message.content, list) else [message.content]
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict) and block.get("type") == "text":
                extras = block.get("extras") or {}
                key = extras.get(STATE_KEY) or block.get(STATE_KEY)
                if key:
                    documents.append((block["text"], str(key)))
                else:
                    parts.append(block["text"])
        text = "\n".join(p for p in parts if p.strip())
        if text:
            turns.append((message.type, text))
    if len(turns) == 1:
        return documents, turns[0][1]
    names = {"human": "User", "ai": "Assistant", "system": "System"}
    return documents, "\n".join(f"{names.get(role, role.title())}: {text}" for role, text in turns)


class ChatKVRAG(KVEngineFields, BaseChatModel):
    """Chat model over a `KVEngine`, for any LangChain pipeline unchanged: the conversation is
    rendered with the model's chat template and every part of it already stored as a verified
    state is grafted (see `KVEngine.stream_chat`); what was read as text is deposited afterwards,
    so the next prompt that begins alike (the same template over the same documents, the next turn
    of a conversation) grafts it. Documents arriving as state blocks (`create_kv_rag_chain`) are
    grafted from their own states instead. The receipt is in `response_metadata["kvrag_receipt"]`.
    Decoding is greedy (deterministic) unless
    `temperature` > 0, then `top_p`, `top_k` and `seed` apply (the same seed, the same tokens);
    each may also be given per call. `timeout` and `max_retries` are accepted for compatibility.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    timeout: float | None = None
    max_retries: int = 0

    def _stream_answer(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]):  # type: ignore[no-untyped-def]
        engine = self._engine()
        options = self._options(stop, kwargs)
        documents, question = _split(messages)
        if documents:
            return engine.stream(question or " ", states=states_for(engine, documents), options=options)
        return engine.stream_chat(_conversation(messages), options=options)

    def _final(self, generation: Generation) -> tuple[UsageMetadata, dict[str, Any]]:
        receipt = generation.receipt
        prompt_tokens = receipt.tokens_reused + receipt.tokens_prefilled
        usage = UsageMetadata(
            input_tokens=prompt_tokens,
            output_tokens=receipt.decode_tokens,
            total_tokens=prompt_tokens + receipt.decode_tokens,
            input_token_details={"cache_read": receipt.tokens_reused},
        )
        metadata = {
            "model_name": self._engine().model.name,
            "model_provider": "kvrag",
            "finish_reason": generation.finish_reason,
            RECEIPT_KEY: receipt.model_dump(mode="json"),
        }
        return usage, metadata

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        generation = self._stream_answer(messages, stop, kwargs).result()
        usage, metadata = self._final(generation)
        message = AIMessage(content=generation.text, usage_metadata=usage, response_metadata=metadata)
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        stream = self._stream_answer(messages, stop, kwargs)
        for delta in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        assert stream.generation is not None
        usage, metadata = self._final(stream.generation)
        yield ChatGenerationChunk(
            message=AIMessageChunk(content="", usage_metadata=usage, response_metadata=metadata, chunk_position="last")
        )

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        # The model runs on a worker thread; the event loop stays free between tokens.
        iterator = self._stream(messages, stop, None, **kwargs)
        done = object()
        while True:
            chunk = await asyncio.to_thread(next, iterator, done)
            if chunk is done:
                break
            if run_manager and chunk.message.content:  # type: ignore[union-attr]
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)  # type: ignore[union-attr]
            yield chunk  # type: ignore[misc]
