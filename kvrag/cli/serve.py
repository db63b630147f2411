"""`kvrag serve`: the OpenAI-compatible server (see `kvrag.server.app`)."""

from __future__ import annotations

import os
import tempfile
from typing import Optional

import typer

from kvrag.cli.common import ATTN, DTYPE, MODEL, fail

EXAMPLE = """Examples:

  kvrag serve --model smollm2-135m --store redis://127.0.0.1:6379/0 --port 8000 --workers 2

  kvrag serve --store redis+cluster://10.0.0.5:7000,10.0.0.6:7000 --hot-mib 1024 --concurrency 2

then, from any OpenAI client: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")"""


def register(app: typer.Typer) -> None:
    @app.command(epilog=EXAMPLE)
    def serve(
        model: str = MODEL,
        store: Optional[str] = typer.Option(
            None, "--store", help="the store the workers share: redis://, redis+cluster://, disk:// (default: disk "
            "store in the user cache; memory:// is per worker)"),
        dtype: str = DTYPE,
        attn: str = ATTN,
        host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
        port: int = typer.Option(8000, "--port", min=0, max=65535),
        workers: int = typer.Option(1, "--workers", min=1, max=64, help="worker processes, each with the model"),
        hot_mib: float = typer.Option(512, "--hot-mib", min=0,
                                      help="each worker's in-process hot tier, in MiB (least recently used go; 0: none)"),
        concurrency: int = typer.Option(1, "--concurrency", min=1, max=64, help="generations at once per worker"),
        queue: int = typer.Option(16, "--queue", min=0, help="requests waiting per worker before 429 Retry-After"),
        max_tokens: int = typer.Option(256, "--max-tokens", min=1, help="when a request gives no max_tokens"),
        served_name: Optional[str] = typer.Option(None, "--served-name", help="the model id clients name (default: --model)"),
        threads: int = typer.Option(0, "--threads", min=0, help="torch threads per worker (0: cores / (workers x concurrency))"),
        grace: float = typer.Option(30, "--grace", min=0, help="seconds to finish requests in flight on shutdown"),
        log_level: str = typer.Option("info", "--log-level", help="uvicorn's: critical, error, warning, info, debug"),
    ) -> None:
        """Serve the model over an OpenAI-compatible HTTP API; workers share states through the store."""
        import uvicorn

        from kvrag.server.app import SETTINGS_ENV, ServeSettings

        try:
            settings = ServeSettings(model=model, store=store, dtype=dtype, attn=attn, hot_mib=hot_mib,
                                     concurrency=concurrency, queue=queue, max_tokens=max_tokens,
                                     served_name=served_name, threads=threads, workers=workers)
            if store:
                from kvrag.stores import open_store

                open_store(settings.store_url()).close()  # a bad URL fails here, once, not in every worker
        except Exception as e:  # noqa: BLE001 - a pydantic or store error, said in one line
            fail(e)
        os.environ[SETTINGS_ENV] = settings.model_dump_json()
        if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvrag-metrics-")
        uvicorn.run("kvrag.server.app:app_from_environment", factory=True, host=host, port=port, workers=workers,
                    timeout_graceful_shutdown=grace or None, log_level=log_level,
                    timeout_worker_healthcheck=60)  # a worker busy in a long prefill is not a dead one
