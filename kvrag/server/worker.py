"""One worker's model: an engine per tenant over it, the generation threads answers run on, and
the batch their decoding steps share.

Workers hold no state of their own that matters: each has a bounded in-process hot tier (an LRU,
`memory://?max_mib=N`) in front of the shared store, so a state deposited through one worker
grafts in every other. Each generation runs on its own thread; the prompt reads take turns on the
model, and the decoding steps of every generation under way advance together, one forward per step
(`kvrag.core.batching`), each answer exactly what it would be alone.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from kvrag.core.batching import Batcher
from kvrag.core.decoding import Generation, GenerationStream
from kvrag.engine.engine import KVEngine
from kvrag.errors import ContextTooLongError, InputError, KVRagError
from kvrag.server import metrics
from kvrag.server.admission import Admission
from kvrag.server.protocol import ApiError
from kvrag.server.settings import ServeSettings

__all__ = ["Worker", "api_error_of"]

log = logging.getLogger("kvrag.server")


class Worker:
    """One model, an engine per tenant over it, the generation threads and their admission."""

    def __init__(self, engine: KVEngine, settings: ServeSettings) -> None:
        self.engine, self.settings = engine, settings
        self.admission = Admission(settings.concurrency, settings.queue)
        self.threads = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="kvrag-generate")
        #: the generations' reads and steps, `concurrency` rows per forward at most (every tenant's)
        self.batcher = Batcher(engine.runner, rows=settings.concurrency, observe=metrics.BATCH_ROWS.observe)
        engine.runtime.batcher = self.batcher if settings.batch else None
        self.system_fingerprint = "kvrag-" + engine.fingerprint[:16]
        self._tenants: dict[str, KVEngine] = {"": engine}
        self._building = threading.Lock()

    def engine_for(self, tenant: str) -> KVEngine:
        """The engine of `tenant` (""): a view over the same runtime (model, buffer pool, deposit
        worker, batch) and store, with the tenant's namespace and key and every other setting the
        server's engine has."""
        with self._building:
            if tenant not in self._tenants:
                self._tenants[tenant] = self.engine.tenant(tenant)
            return self._tenants[tenant]

    @property
    def tenants(self) -> int:
        """Tenants whose engines this worker has made (the server's own included)."""
        with self._building:
            return len(self._tenants)

    def close(self) -> None:
        """After the last request: the generation threads, the deposits queued, then the batch."""
        self.threads.shutdown(wait=True)
        self.engine.runtime.close()
        self.batcher.close()

    def check_model(self, name: str) -> None:
        if name not in (self.settings.name, self.engine.model.name):
            raise ApiError(404, f"the model {name!r} is not served here; this server serves {self.settings.name!r} "
                           "(GET /v1/models)", code="model_not_found", param="model")

    async def events(self, build: Callable[[], GenerationStream], arrived: float) -> AsyncIterator[str | Generation]:
        """Run `build()`'s stream in a generation thread: its text deltas, then its `Generation`.
        The slot is held until the thread is done, even if the client goes away first (the thread
        then stops at the next token)."""
        await self.admission.acquire()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        gone = threading.Event()
        started = time.perf_counter()

        def send(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))

        future = loop.run_in_executor(self.threads, _generate, build, send, gone, arrived)
        future.add_done_callback(lambda _: self.admission.release(time.perf_counter() - started))
        try:
            while True:
                kind, value = await events.get()
                if kind == "error":
                    raise api_error_of(value)
                yield value
                if kind == "done":
                    return
        finally:
            gone.set()


def _generate(build: Callable[[], GenerationStream], send: Callable[[str, Any], None], gone: threading.Event,
              arrived: float) -> None:
    """On a generation thread: each delta sent until the client is gone, then the generation (or the error)."""
    first: float | None = None
    try:
        stream = build()
        for delta in stream:
            first = first or time.perf_counter()
            if gone.is_set():
                return
            send("delta", delta)
        generation = stream.result()
        metrics.observe(generation.receipt, (first or time.perf_counter()) - arrived)
        send("done", generation)
    except BaseException as e:  # noqa: BLE001 - handed to the request, which maps it
        send("error", e)


def api_error_of(e: BaseException) -> ApiError:
    """The HTTP error a failed generation answers with: the caller's input a 400, kvrag's own a 500."""
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
