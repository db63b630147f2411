"""`kvrag serve`: an OpenAI-compatible HTTP server over one `KVEngine` per worker process.

    POST /v1/chat/completions   (`stream: true`: server-sent events)
    POST /v1/completions        the prompt is one user message
    GET  /v1/models             the served model
    GET  /health                model, fingerprints, tiers and their breakers
    GET  /metrics               Prometheus (see `kvrag.server.metrics`)

With API keys (`ServeSettings.api_keys`, `kvrag serve --api-key`), every route needs
`Authorization: Bearer <key>` (`/health` and `/metrics` too, unless `open_health`); a missing or
wrong key is a 401 in OpenAI's shape. Keys are compared in constant time, and each maps to a
tenant: its requests run on an engine whose namespace is that tenant, with the tenant's key
derived from the operator's (`kvrag.trust.tenants`), so tenants on one server share neither
states nor memo, and the metrics count each tenant's requests apart.

Workers hold no state of their own that matters: each has a bounded in-process hot tier (an LRU,
`memory://?max_mib=N`) in front of the shared store, so a state deposited through one worker
grafts in every other. Each worker runs at most `concurrency` generations at once, in threads
(the model is read-only), and keeps at most `queue` requests waiting; beyond that it answers
429 with `Retry-After` instead of letting latency grow without bound. On SIGTERM uvicorn stops
accepting and finishes the requests and streams in flight. Every response names its worker in
the `x-kvrag-worker` header.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrag.core.decoding import Generation, GenerationStream
from kvrag.engine.engine import KVEngine
from kvrag.errors import ContextTooLongError, InputError, KVRagError
from kvrag.server import metrics
from kvrag.server import openai_api as api
from kvrag.server.openai_api import ApiError, ChatRequest, CompletionRequest
from kvrag.stores.deadline import DEFAULT_DEADLINE_S

__all__ = ["ApiKey", "ServeSettings", "create_app", "app_from_environment", "SETTINGS_ENV"]

log = logging.getLogger("kvrag.server")

#: The environment variable that carries `ServeSettings` (JSON) to uvicorn's worker processes.
SETTINGS_ENV = "KVRAG_SERVE_SETTINGS"
WORKER_HEADER = "x-kvrag-worker"


class ApiKey(BaseModel):
    """A key a client presents, and the tenant whose states its requests read and write ("": the
    server's own namespace)."""

    key: str = Field(min_length=8)
    tenant: str = ""


class ServeSettings(BaseModel):
    """What one worker needs to build its engine and admit requests."""

    model: str = "smollm2-135m"
    #: the shared store (Redis, Redis Cluster, disk); the hot tier goes in front of it
    store: str | None = None
    dtype: str | None = None
    attn: str | None = None
    #: the in-process hot tier's cap (0: none)
    hot_mib: float = Field(default=512, ge=0)
    #: generations run at once per worker
    concurrency: int = Field(default=1, ge=1, le=64)
    #: requests waiting per worker beyond those; more are answered 429
    queue: int = Field(default=16, ge=0, le=10_000)
    #: `max_tokens` when a request gives none
    max_tokens: int = Field(default=256, ge=1, le=1 << 16)
    #: the model id clients name (default: `model`)
    served_name: str | None = None
    #: torch threads in this worker (0: the machine's cores shared out among workers and slots)
    threads: int = Field(default=0, ge=0, le=512)
    #: worker processes on this machine (to share the cores out)
    workers: int = Field(default=1, ge=1, le=64)
    #: the keys clients must present (none: every client is let in)
    api_keys: list[ApiKey] = Field(default_factory=list)
    #: `/health` and `/metrics` answer without a key
    open_health: bool = False
    #: the most a question waits on store reads before the text answers
    deadline_s: float = Field(default_factory=lambda: DEFAULT_DEADLINE_S, gt=0, le=3600)

    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant of `Authorization: Bearer <key>`, or None if it names no key here. Every key is
        compared, in constant time, whichever matches."""
        scheme, _, token = (authorization or "").partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else b""
        found = None
        for entry in self.api_keys:
            if hmac.compare_digest(entry.key.encode(), presented) and presented:
                found = entry.tenant
        return found

    @property
    def name(self) -> str:
        return self.served_name or self.model

    def store_url(self) -> str | None:
        if not self.hot_mib or (self.store or "").startswith("memory://"):
            return self.store
        from kvrag.stores import default_store_url

        return f"memory://?max_mib={self.hot_mib:g},{self.store or default_store_url()}"

    def torch_threads(self) -> int:
        """Workers on one machine must not oversubscribe its cores: threads fighting over cores
        slow every forward down."""
        return self.threads or max(1, (os.cpu_count() or 1) // (self.workers * self.concurrency))


class Admission:
    """At most `concurrency` generations at once and `queue` waiting; the rest are refused with
    a `Retry-After` estimated from recent durations."""

    def __init__(self, concurrency: int, queue: int) -> None:
        self.concurrency, self.queue = concurrency, queue
        self._slots = asyncio.Semaphore(concurrency)
        self.waiting = self.running = 0
        self._durations: deque[float] = deque(maxlen=32)

    async def acquire(self) -> None:
        if self._slots.locked() and self.waiting >= self.queue:
            metrics.REJECTED.labels("queue-full").inc()
            raise ApiError(429, f"all {self.concurrency} generation slots are busy and {self.queue} requests are "
                           "waiting; retry after the time in Retry-After", type="requests", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.retry_after())})
        self.waiting += 1
        metrics.QUEUED.inc()
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
            metrics.QUEUED.dec()
        self.running += 1
        metrics.IN_FLIGHT.inc()

    def release(self, seconds: float) -> None:
        self._durations.append(seconds)
        self.running -= 1
        metrics.IN_FLIGHT.dec()
        self._slots.release()

    def retry_after(self) -> int:
        typical = sorted(self._durations)[len(self._durations) // 2] if self._durations else 1.0
        return max(1, math.ceil(typical * (self.waiting + 1) / self.concurrency))


class Worker:
    """One model, an engine per tenant over it, the generation threads and their admission."""

    def __init__(self, engine: KVEngine, settings: ServeSettings) -> None:
        self.engine, self.settings = engine, settings
        self.admission = Admission(settings.concurrency, settings.queue)
        self.threads = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="kvrag-generate")
        self.fingerprint = "kvrag-" + engine.fingerprint[:16]
        self._tenants: dict[str, KVEngine] = {"": engine}
        self._building = threading.Lock()

    def engine_for(self, tenant: str) -> KVEngine:
        """The engine of `tenant` (""): the same model and store, the tenant's namespace and key."""
        with self._building:
            if tenant not in self._tenants:
                base = self.engine
                self._tenants[tenant] = KVEngine(base.model, base.store, namespace=tenant, deadline_s=base.deadline_s)
            return self._tenants[tenant]

    async def events(self, build: Callable[[], GenerationStream], arrived: float) -> AsyncIterator[str | Generation]:
        """Run `build()`'s stream in a generation thread: its text deltas, then its `Generation`.
        The slot is held until the thread is done, even if the client goes away first (the thread
        then stops at the next token)."""
        await self.admission.acquire()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        gone = threading.Event()
        started = time.perf_counter()
        first: list[float] = []

        def send(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))

        def work() -> None:
            try:
                stream = build()
                for delta in stream:
                    if not first:
                        first.append(time.perf_counter())
                    if gone.is_set():
                        return
                    send("delta", delta)
                generation = stream.result()
                metrics.observe(generation.receipt, (first[0] if first else time.perf_counter()) - arrived)
                send("done", generation)
            except BaseException as e:  # noqa: BLE001 - handed to the request, which maps it
                send("error", e)

        future = loop.run_in_executor(self.threads, work)
        future.add_done_callback(lambda _: self.admission.release(time.perf_counter() - started))
        try:
            while True:
                kind, value = await events.get()
                if kind == "error":
                    raise _api_error(value)
                yield value
                if kind == "done":
                    return
        finally:
            gone.set()

    # ----------------------------------------------------------------- requests
    def check_model(self, name: str) -> None:
        if name not in (self.settings.name, self.engine.model.name):
            raise ApiError(404, f"the model {name!r} is not served here; this server serves {self.settings.name!r} "
                           "(GET /v1/models)", code="model_not_found", param="model")

    def options(self, request: ChatRequest | CompletionRequest) -> dict[str, Any]:
        return {
            "max_new_tokens": request.limit(self.settings.max_tokens),
            "stop": request.stops or None,
            "graft": request.kvrag.graft,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "seed": request.seed,
        }

    def chat_stream(self, request: ChatRequest, engine: KVEngine) -> Callable[[], GenerationStream]:
        conversation = request.conversation()
        options = self.options(request)
        kv = request.kvrag
        deposit = kv.deposit and kv.graft

        def build() -> GenerationStream:
            if kv.documents:
                from kvrag.apps.frameworks import states_for

                states = states_for(engine, [(d.text, d.state_key) for d in kv.documents])
                return engine.stream(question_of(conversation), states=states, deposit_missing=deposit,
                                     memo=kv.memo, **options)
            return engine.stream_chat(conversation, deposit_missing=deposit, **options)

        return build

    def completion_stream(self, request: CompletionRequest, engine: KVEngine) -> Callable[[], GenerationStream]:
        if request.kvrag.documents:
            chat = ChatRequest.model_validate({**request.model_dump(exclude={"prompt"}),
                                               "messages": [{"role": "user", "content": request.text}]})
            return self.chat_stream(chat, engine)
        options = self.options(request)
        deposit = request.kvrag.deposit and request.kvrag.graft

        def build() -> GenerationStream:  # a base model continues the prompt as given; a chat model reads one user turn
            return engine.stream_complete(request.text, deposit_missing=deposit, **options)

        return build


def question_of(conversation: list[dict[str, str]]) -> str:
    """The question to ask after explicit documents: a lone message's text, else the turns as
    `Role: text` lines (so no system prompt or earlier turn is dropped)."""
    if len(conversation) == 1:
        return conversation[0]["content"]
    return "\n".join(f"{m['role'].title()}: {m['content']}" for m in conversation if m["content"].strip())


def _api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ContextTooLongError):
        return ApiError(400, str(e), code="context_length_exceeded", param="messages")
    if isinstance(e, InputError):
        return ApiError(400, str(e))
    if isinstance(e, KVRagError):
        log.error("generation failed: %s", e)
        return ApiError(500, f"kvrag could not answer: {e}", type="server_error")
    log.exception("generation failed", exc_info=e)
    return ApiError(500, f"internal error ({type(e).__name__}); see the server log", type="server_error")


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


# ---------------------------------------------------------------------------------------- app
def create_app(settings: ServeSettings, engine: KVEngine | None = None) -> FastAPI:
    """The ASGI app; the engine is built on startup unless one is given (tests, embedding)."""
    state: dict[str, Any] = {}

    def serve(opened: KVEngine) -> None:
        state["worker"] = Worker(opened, settings)
        threads = opened.identity.hardware.num_threads
        log.info("kvrag worker %d serving %s (%s) from %s; its states are keyed for %s", os.getpid(), settings.name,
                 opened.fingerprint[:12], opened.store.url,
                 f"{threads} torch threads (states made with another count are read as text)" if threads
                 else "any thread count (the invariant kernel)")

    async def load() -> None:
        """The model loads while the port already answers: 503 `loading` (with Retry-After) until then."""
        import torch

        torch.set_num_threads(settings.torch_threads())
        try:
            serve(await asyncio.to_thread(KVEngine.open, settings.model, settings.store_url(), dtype=settings.dtype,
                                          attn=settings.attn, deadline_s=settings.deadline_s))
        except Exception as e:  # the worker cannot serve: say so, and stop (as a failed start always did)
            state["failed"] = e
            log.error("kvrag worker %d could not load %s: %s; stopping", os.getpid(), settings.model, e)
            os.kill(os.getpid(), signal.SIGINT)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = None
        if engine is None:
            loading = asyncio.create_task(load())
        else:
            serve(engine)
        yield
        if loading is not None and not loading.done():
            loading.cancel()
        if "worker" in state:
            state["worker"].threads.shutdown(wait=True)

    app = FastAPI(title="kvrag", summary="OpenAI-compatible answers from verified, grafted KV states",
                  lifespan=lifespan)

    def worker() -> Worker:
        if "failed" in state:
            raise ApiError(503, f"this worker could not load its model: {state['failed']}", type="server_error",
                           code="model_unavailable")
        if "worker" not in state:
            raise ApiError(503, "the model is still loading; retry after the time in Retry-After", type="server_error",
                           code="loading", headers={"Retry-After": "2"})
        return state["worker"]

    @app.middleware("http")
    async def count(request: Request, call_next: Callable[[Request], Any]) -> Response:
        request.state.tenant = ""
        guarded = request.url.path.startswith("/v1") or not settings.open_health
        if settings.api_keys and guarded:
            tenant = settings.tenant_of(request.headers.get("authorization"))
            if tenant is None:
                metrics.REQUESTS.labels("unauthorized", "401").inc()
                return JSONResponse(api.error_body(
                    "Incorrect or missing API key: send `Authorization: Bearer <key>` with a key this server was "
                    "started with (kvrag serve --api-key)", code="invalid_api_key"), status_code=401,
                    headers={"WWW-Authenticate": "Bearer", WORKER_HEADER: str(os.getpid())})
            request.state.tenant = tenant
        response = await call_next(request)
        response.headers[WORKER_HEADER] = str(os.getpid())
        metrics.REQUESTS.labels(request.url.path if request.url.path.startswith("/v1/") else "other",
                                str(response.status_code)).inc()
        if request.url.path.startswith("/v1/") and settings.api_keys:
            metrics.TENANT_REQUESTS.labels(request.state.tenant or "-", str(response.status_code)).inc()
        return response

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden" and where:
            message = (f"unknown field `{where[-1]}`: kvrag serve refuses fields it does not implement rather than "
                       "ignore them")
        return JSONResponse(api.error_body(f"{message} ({'.'.join(where) or 'body'})", param=".".join(where) or None),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(api.error_body(str(e.detail), code=code), status_code=e.status_code)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        w = worker()
        return {
            "status": "ok", "model": w.settings.name, "model_fingerprint": w.engine.fingerprint,
            "hardware_fingerprint": w.engine.identity.hardware.digest, "worker": os.getpid(),
            "running": w.admission.running, "waiting": w.admission.waiting,
            "tiers": [{"kind": t.url.partition("://")[0], "open": not t.breaker.is_open} for t in w.engine.tiers],
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=metrics.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        w = worker()
        return {"object": "list", "data": [{"id": w.settings.name, "object": "model", "created": 0,
                                            "owned_by": "kvrag", "kvrag_fingerprint": w.engine.fingerprint}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: ChatRequest, http: Request) -> Response | dict[str, Any]:
        return await _respond(worker, request, http.state.tenant)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: CompletionRequest, http: Request) -> Response | dict[str, Any]:
        return await _respond(worker, request, http.state.tenant)

    return app


async def _respond(worker: Callable[[], Worker], request: ChatRequest | CompletionRequest,
                   tenant: str) -> Response | dict[str, Any]:
    arrived = time.perf_counter()
    w = worker()
    w.check_model(request.model)
    chat = isinstance(request, ChatRequest)
    engine = w.engine_for(tenant)
    build = w.chat_stream(request, engine) if chat else w.completion_stream(request, engine)
    id = api.new_id("chatcmpl" if chat else "cmpl")
    name, fingerprint = w.settings.name, w.fingerprint
    events = w.events(build, arrived)
    if not request.stream:
        generation = None
        async for event in events:
            if isinstance(event, Generation):
                generation = event
        assert generation is not None
        return (api.chat_response if chat else api.completion_response)(id, name, fingerprint, generation)
    created = int(time.time())
    # the first event before any byte is sent, so that an error before the first token is an HTTP error
    first = await events.__anext__()

    async def body() -> AsyncIterator[bytes]:
        try:
            if chat:
                yield _sse(api.chat_chunk(id, name, fingerprint, created, delta={"role": "assistant", "content": ""}))
            event: str | Generation = first
            while True:
                if isinstance(event, Generation):
                    break
                yield _sse(api.chat_chunk(id, name, fingerprint, created, delta={"content": event}) if chat
                           else api.completion_chunk(id, name, fingerprint, created, text=event))
                event = await events.__anext__()
            closing = api.chat_chunk if chat else api.completion_chunk
            yield _sse(closing(id, name, fingerprint, created, generation=event))
            if request.include_usage:
                yield _sse(closing(id, name, fingerprint, created, generation=event, usage=True))
        except ApiError as e:  # after the headers went out: the error travels as an event
            yield _sse(e.body())
        finally:
            await events.aclose()
        yield _sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def app_from_environment() -> FastAPI:
    """uvicorn's factory in each worker process: the settings come from `KVRAG_SERVE_SETTINGS`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return create_app(ServeSettings.model_validate_json(os.environ.get(SETTINGS_ENV, "{}")))

