"""What every generating endpoint shares: admit the request, run it on its tenant's engine, answer
whole or as server-sent events. `serving_chat` and `serving_completion` say what their requests
run and how their responses and chunks look."""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from typing import Any, AsyncIterator, Callable, Generic, TypeVar

from fastapi.responses import StreamingResponse

from kvrag.core.decoding import Generation, GenerationStream
from kvrag.engine.engine import KVEngine
from kvrag.server.protocol import ApiError, ChatRequest, CompletionRequest, new_id
from kvrag.server.worker import Worker

__all__ = ["Serving", "sse"]

R = TypeVar("R", ChatRequest, CompletionRequest)


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


class Serving(ABC, Generic[R]):
    """One endpoint: what a request runs, and its whole response and chunks."""

    #: the prefix of response ids (`chatcmpl`, `cmpl`)
    id_prefix: str

    def __init__(self, worker: Callable[[], Worker]) -> None:
        self.worker = worker

    @abstractmethod
    def build(self, request: R, engine: KVEngine) -> Callable[[], GenerationStream]:
        """The stream to run for `request` on `engine` (built on a generation thread)."""

    @abstractmethod
    def whole(self, id: str, worker: Worker, generation: Generation) -> dict[str, Any]:
        """The response body of a request that did not ask to stream."""

    @abstractmethod
    def chunks(self, id: str, worker: Worker, created: int, event: str | Generation | None,
               usage: bool = False) -> list[dict[str, Any]]:
        """The chunk bodies of one event: None opens the stream, text is a delta, a `Generation`
        closes it (with `usage`, the usage-only chunk that follows)."""

    async def respond(self, request: R, tenant: str) -> StreamingResponse | dict[str, Any]:
        arrived = time.perf_counter()
        worker = self.worker()
        worker.check_model(request.model)
        events = worker.events(self.build(request, worker.engine_for(tenant)), arrived)
        id = new_id(self.id_prefix)
        if not request.stream:
            async for event in events:
                if isinstance(event, Generation):
                    return self.whole(id, worker, event)
            raise ApiError(500, "the generation ended without an answer", type="server_error")
        # the first event before any byte is sent, so that an error before the first token is an HTTP error
        first = await events.__anext__()
        body = self._events(id, worker, request.include_usage, first, events)
        return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _events(self, id: str, worker: Worker, include_usage: bool, first: str | Generation,
                      events: AsyncIterator[str | Generation]) -> AsyncIterator[bytes]:
        created = int(time.time())
        try:
            for chunk in self.chunks(id, worker, created, None):
                yield sse(chunk)
            event = first
            while not isinstance(event, Generation):
                for chunk in self.chunks(id, worker, created, event):
                    yield sse(chunk)
                event = await events.__anext__()
            for chunk in self.chunks(id, worker, created, event, usage=include_usage):
                yield sse(chunk)
        except ApiError as e:  # after the headers went out: the error travels as an event
            yield sse(e.body())
        finally:
            await events.aclose()  # type: ignore[attr-defined]
        yield sse("[DONE]")
