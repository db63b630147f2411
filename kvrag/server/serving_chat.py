"""`POST /v1/chat/completions`: a conversation, or explicit documents and a question."""

from __future__ import annotations

from typing import Any, Callable

from kvrag.core.decoding import Generation, GenerationStream
from kvrag.engine.engine import KVEngine
from kvrag.server.protocol import ChatCompletion, ChatCompletionChunk, ChatRequest, ChunkChoice, Usage
from kvrag.server.serving import Serving
from kvrag.server.worker import Worker

__all__ = ["ServingChat", "question_of"]


class ServingChat(Serving[ChatRequest]):
    id_prefix = "chatcmpl"

    def build(self, request: ChatRequest, engine: KVEngine) -> Callable[[], GenerationStream]:
        conversation = request.conversation()
        options = request.options(self.worker().settings.max_tokens)
        documents = [(d.text, d.state_key) for d in request.kvrag.documents]

        def build() -> GenerationStream:
            if documents:
                from kvrag.apps.frameworks import states_for

                return engine.stream(question_of(conversation), states=states_for(engine, documents), options=options)
            return engine.stream_chat(conversation, options=options)

        return build

    def whole(self, id: str, worker: Worker, generation: Generation) -> dict[str, Any]:
        return ChatCompletion.of(id, worker.settings.name, worker.system_fingerprint, generation).body()

    def chunks(self, id: str, worker: Worker, created: int, event: str | Generation | None,
               usage: bool = False) -> list[dict[str, Any]]:
        def chunk(delta: dict[str, str], generation: Generation | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=id, created=created, model=worker.settings.name, system_fingerprint=worker.system_fingerprint,
                choices=[ChunkChoice(delta=delta, finish_reason=generation.finish_reason if generation else None)],
                kvrag_receipt=generation.receipt.model_dump(mode="json") if generation else None)

        if event is None:
            return [chunk({"role": "assistant", "content": ""}).body()]
        if isinstance(event, str):
            return [chunk({"content": event}).body()]
        closing = [chunk({}, event).body()]
        if usage:
            closing.append(ChatCompletionChunk(id=id, created=created, model=worker.settings.name,
                                               system_fingerprint=worker.system_fingerprint, choices=[],
                                               usage=Usage.of(event.receipt)).body())
        return closing


def question_of(conversation: list[dict[str, str]]) -> str:
    """The question to ask after explicit documents: a lone message's text, else the turns as
    `Role: text` lines (so no system prompt or earlier turn is dropped)."""
    if len(conversation) == 1:
        return conversation[0]["content"]
    return "\n".join(f"{m['role'].title()}: {m['content']}" for m in conversation if m["content"].strip())
