"""`kvrag serve`: an OpenAI-compatible HTTP server over one `KVEngine` per worker process.

    POST /v1/chat/completions   (`stream: true`: server-sent events)   `serving_chat`
    POST /v1/completions        a prompt continued, or one user turn   `serving_completion`
    GET  /v1/models             the served model
    GET  /health                model, fingerprints, tiers and their breakers
    GET  /metrics               Prometheus (see `kvrag.server.metrics`)

This module wires the parts: the settings (`settings`), API keys and their tenants (`auth`), the
wire format (`protocol`), admission (`admission`) and the worker's engines and threads
(`worker`). Tenants on one server share neither states nor memo: each key's requests run on an
engine whose namespace is its tenant, with the tenant's key derived from the operator's
(`kvrag.trust.tenants`), and the metrics count each tenant's requests apart. On SIGTERM uvicorn
stops accepting and finishes the requests and streams in flight. Every response names its worker
in the `x-kvrag-worker` header.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrag.engine.engine import KVEngine
from kvrag.server import metrics
from kvrag.server.auth import UNAUTHORIZED, authorized_tenant, needs_key
from kvrag.server.protocol import ApiError, ChatRequest, CompletionRequest, error_body
from kvrag.server.serving_chat import ServingChat
from kvrag.server.serving_completion import ServingCompletion
from kvrag.server.settings import SETTINGS_ENV, ApiKey, ServeSettings
from kvrag.server.worker import Worker

__all__ = ["ApiKey", "ServeSettings", "create_app", "app_from_environment", "SETTINGS_ENV"]

log = logging.getLogger("kvrag.server")

WORKER_HEADER = "x-kvrag-worker"


@dataclass
class AppState:
    """A worker process's state: its worker once the model has loaded, or why it could not load."""

    settings: ServeSettings
    worker: Worker | None = None
    failed: Exception | None = None

    def ready(self) -> Worker:
        """The worker, or the 503 that says why there is none yet."""
        if self.failed is not None:
            raise ApiError(503, f"this worker could not load its model: {self.failed}", type="server_error",
                           code="model_unavailable")
        if self.worker is None:
            raise ApiError(503, "the model is still loading; retry after the time in Retry-After", type="server_error",
                           code="loading", headers={"Retry-After": "2"})
        return self.worker

    def serve(self, engine: KVEngine) -> None:
        self.worker = Worker(engine, self.settings)
        threads = engine.identity.hardware.num_threads
        log.info("kvrag worker %d serving %s (%s) from %s; its states are keyed for %s", os.getpid(),
                 self.settings.name, engine.fingerprint[:12], engine.store.url,
                 f"{threads} torch threads (states made with another count are read as text)" if threads
                 else "any thread count (the invariant kernel)")

    async def load(self) -> None:
        """The model loads while the port already answers: 503 `loading` (with Retry-After) until then."""
        import torch

        settings = self.settings
        torch.set_num_threads(settings.torch_threads())
        try:
            self.serve(await asyncio.to_thread(KVEngine.open, settings.model, settings.store_url(),
                                               dtype=settings.dtype, attn=settings.attn,
                                               deadline_s=settings.deadline_s))
        except Exception as e:  # the worker cannot serve: say so, and stop
            self.failed = e
            log.error("kvrag worker %d could not load %s: %s; stopping", os.getpid(), settings.model, e)
            os.kill(os.getpid(), signal.SIGINT)


def create_app(settings: ServeSettings, engine: KVEngine | None = None) -> FastAPI:
    """The ASGI app; the engine is built on startup unless one is given (tests, embedding)."""
    state = AppState(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(state.load()) if engine is None else None
        if engine is not None:
            state.serve(engine)
        yield
        if loading is not None and not loading.done():
            loading.cancel()
        if state.worker is not None:
            state.worker.close()

    app = FastAPI(title="kvrag", summary="OpenAI-compatible answers from verified, grafted KV states",
                  lifespan=lifespan)
    app.middleware("http")(_authenticated(settings))
    _errors(app)
    _routes(app, state)
    return app


def _authenticated(settings: ServeSettings) -> Callable[[Request, Any], Any]:
    """The middleware that finds each request's tenant (a 401 without a valid key where one is
    needed), names the worker and counts the request."""

    async def middleware(request: Request, call_next: Callable[[Request], Any]) -> Response:
        request.state.tenant = ""
        if needs_key(settings, request.url.path):
            tenant = authorized_tenant(settings.api_keys, request.headers.get("authorization"))
            if tenant is None:
                metrics.REQUESTS.labels("unauthorized", "401").inc()
                return JSONResponse(error_body(UNAUTHORIZED, code="invalid_api_key"), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer", WORKER_HEADER: str(os.getpid())})
            request.state.tenant = tenant
        response = await call_next(request)
        response.headers[WORKER_HEADER] = str(os.getpid())
        api = request.url.path.startswith("/v1/")
        metrics.REQUESTS.labels(request.url.path if api else "other", str(response.status_code)).inc()
        if api and settings.api_keys:
            metrics.TENANT_REQUESTS.labels(request.state.tenant or "-", str(response.status_code)).inc()
        return response

    return middleware


def _errors(app: FastAPI) -> None:
    """Every error in OpenAI's shape."""

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
        return JSONResponse(error_body(f"{message} ({'.'.join(where) or 'body'})", param=".".join(where) or None),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(error_body(str(e.detail), code=code), status_code=e.status_code)


def _routes(app: FastAPI, state: AppState) -> None:
    chat, completion = ServingChat(state.ready), ServingCompletion(state.ready)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        w = state.ready()
        return {
            "status": "ok", "model": w.settings.name, "model_fingerprint": w.engine.fingerprint,
            "hardware_fingerprint": w.engine.identity.hardware.digest, "worker": os.getpid(),
            "running": w.admission.running, "waiting": w.admission.waiting,
            "batch": {"exact": w.batcher.exact, "rows": w.batcher.rows, "forwards": w.batcher.forwards,
                      "stepped_rows": w.batcher.stepped_rows},
            "tiers": [{"kind": t.url.partition("://")[0], "open": not t.breaker.is_open} for t in w.engine.tiers],
            # every tenant's engine is a view over the worker's one runtime: one deposit worker, one buffer pool
            "tenants": w.tenants,
            "deposits": asdict(w.engine.deposits.stats) | {"pending_bytes": w.engine.deposits.pending_bytes},
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=metrics.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        w = state.ready()
        return {"object": "list", "data": [{"id": w.settings.name, "object": "model", "created": 0,
                                            "owned_by": "kvrag", "kvrag_fingerprint": w.engine.fingerprint}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: ChatRequest, http: Request) -> StreamingResponse | dict[str, Any]:
        return await chat.respond(request, http.state.tenant)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: CompletionRequest, http: Request) -> StreamingResponse | dict[str, Any]:
        return await completion.respond(request, http.state.tenant)


def app_from_environment() -> FastAPI:
    """uvicorn's factory in each worker process: the settings come from `KVRAG_SERVE_SETTINGS`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    kvrag_log = logging.getLogger("kvrag")
    for handler in [h for h in kvrag_log.handlers if getattr(h, "kvrag_cli", False)]:
        kvrag_log.removeHandler(handler)  # the server's own lines say it once, with the time
    return create_app(ServeSettings.model_validate_json(os.environ.get(SETTINGS_ENV, "{}")))
