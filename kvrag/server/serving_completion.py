"""`POST /v1/completions`: a base model continues the prompt as given; a chat model reads it as one
user message; with explicit documents it is the question asked after them."""

from __future__ import annotations

from typing import Any, Callable

from kvrag.core.decoding import Generation, GenerationStream
from kvrag.engine.engine import KVEngine
from kvrag.server.protocol import ChatRequest, Completion, CompletionChoice, CompletionRequest, Usage
from kvrag.server.serving import Serving
from kvrag.server.serving_chat import ServingChat
from kvrag.server.worker import Worker

__all__ = ["ServingCompletion"]


class ServingCompletion(Serving[CompletionRequest]):
    id_prefix = "cmpl"

    def build(self, request: CompletionRequest, engine: KVEngine) -> Callable[[], GenerationStream]:
        if request.kvrag.documents:
            chat = ChatRequest.model_validate({**request.model_dump(exclude={"prompt"}),
                                               "messages": [{"role": "user", "content": request.text}]})
            return ServingChat(self.worker).build(chat, engine)
        options = request.options(self.worker().settings.max_tokens)
        return lambda: engine.stream_complete(request.text, options=options)

    def whole(self, id: str, worker: Worker, generation: Generation) -> dict[str, Any]:
        return Completion.of(id, worker.settings.name, worker.system_fingerprint, generation).body()

    def chunks(self, id: str, worker: Worker, created: int, event: str | Generation | None,
               usage: bool = False) -> list[dict[str, Any]]:
        def chunk(text: str, generation: Generation | None = None) -> Completion:
            return Completion(id=id, created=created, model=worker.settings.name, system_fingerprint=worker.system_fingerprint,
                              choices=[CompletionChoice(text=text, finish_reason=generation.finish_reason
                                                        if generation else None)],
                              kvrag_receipt=generation.receipt.model_dump(mode="json") if generation else None)

        if event is None:
            return []
        if isinstance(event, str):
            return [chunk(event).body()]
        closing = [chunk("", event).body()]
        if usage:
            closing.append(Completion(id=id, created=created, model=worker.settings.name,
                                      system_fingerprint=worker.system_fingerprint, choices=[],
                                      usage=Usage.of(event.receipt)).body())
        return closing
