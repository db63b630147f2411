"""`kvrag serve`: the OpenAI-compatible server (see `kvrag.server.app`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, List, Literal, Optional

import typer

from kvrag.cli.common import ATTN, DEADLINE, DTYPE, MODEL, SIGNING_KEY_FILE, Attn, Dtype, err, fail

if TYPE_CHECKING:
    from kvrag.server.settings import ServeSettings

EXAMPLE = """Examples:

  kvrag serve --model smollm2-135m --store redis://127.0.0.1:6379/0 --port 8000 --workers 2

  kvrag serve --store redis+cluster://10.0.0.5:7000,10.0.0.6:7000 --hot-mib 1024 --concurrency 32

  kvrag serve --no-batch --concurrency 2     (each generation's steps alone, the cores shared out)

  kvrag serve --host 0.0.0.0 --api-key-file keys.txt     (lines "KEY TENANT": one tenant per key)

then, from any OpenAI client: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
(with --api-key: api_key=<that key>)"""

#: Keys for the server's own namespace, comma-separated (as vLLM's VLLM_API_KEY).
API_KEY_ENV = "KVRAG_API_KEY"


def read_api_keys(keys: list[str], key_file: str | None) -> list[dict[str, str]]:
    """`--api-key` values, `$KVRAG_API_KEY`, and a key file's lines (`KEY` or `KEY TENANT`; `#` comments)."""
    entries = [{"key": k} for k in keys]
    entries += [{"key": k.strip()} for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    if key_file:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise typer.BadParameter(f"cannot read the key file {key_file}: {e}") from e
        for number, line in enumerate(lines, 1):
            fields = line.split("#", 1)[0].split()
            if len(fields) > 2:
                raise typer.BadParameter(f"{key_file}:{number}: expected `KEY` or `KEY TENANT`")
            if fields:
                entries.append({"key": fields[0], "tenant": fields[1] if len(fields) == 2 else ""})
    return entries


def register(app: typer.Typer) -> None:
    @app.command(epilog=EXAMPLE)
    def serve(
        model: str = MODEL,
        store: Optional[str] = typer.Option(
            None, "--store", help="the store the workers share: redis://, redis+cluster://, disk:// (default: disk "
            "store in the user cache; memory:// is per worker)"),
        dtype: Dtype = DTYPE,
        attn: Attn = ATTN,
        host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
        port: int = typer.Option(8000, "--port", min=0, max=65535),
        workers: int = typer.Option(1, "--workers", min=1, max=64, help="worker processes, each with the model"),
        hot_mib: float = typer.Option(512, "--hot-mib", min=0,
                                      help="each worker's in-process hot tier, in MiB (least recently used go; 0: none)"),
        concurrency: int = typer.Option(16, "--concurrency", min=1, max=64,
                                        help="generations at once per worker: the rows of its decoding batch"),
        batch: bool = typer.Option(True, "--batch/--no-batch",
                                   help="the generations' decoding steps share one forward (each answer exactly as alone)"),
        queue: int = typer.Option(16, "--queue", min=0, help="requests waiting per worker before 429 Retry-After"),
        max_tokens: int = typer.Option(256, "--max-tokens", min=1, help="when a request gives no max_tokens"),
        served_name: Optional[str] = typer.Option(None, "--served-name", help="the model id clients name (default: --model)"),
        threads: int = typer.Option(0, "--threads", min=0, help="torch threads per worker (0: cores / workers; with --no-batch, / concurrency too)"),
        grace: float = typer.Option(30, "--grace", min=0, help="seconds to finish requests in flight on shutdown"),
        log_level: Literal["critical", "error", "warning", "info", "debug"] = typer.Option(
            "info", "--log-level", help="uvicorn's log level"),
        api_key: List[str] = typer.Option([], "--api-key", help="a key clients must send as `Authorization: Bearer` "
                                          f"(repeatable; also ${API_KEY_ENV}, comma-separated)"),
        api_key_file: Optional[str] = typer.Option(None, "--api-key-file",
                                                   help="lines `KEY TENANT` (or `KEY`): each tenant's states apart"),
        open_health: bool = typer.Option(False, "--open-health", help="/health and /metrics answer without a key"),
        signing_key_file: Optional[str] = SIGNING_KEY_FILE,
        deadline: Optional[float] = DEADLINE,
    ) -> None:
        """Serve the model over an OpenAI-compatible HTTP API; workers share states through the store."""
        import uvicorn

        from kvrag.server.app import SETTINGS_ENV, ServeSettings

        try:
            _share_signing_key(signing_key_file)
            settings = ServeSettings(model=model, store=store, dtype=dtype, attn=attn, hot_mib=hot_mib,
                                     concurrency=concurrency, batch=batch, queue=queue, max_tokens=max_tokens,
                                     served_name=served_name, threads=threads, workers=workers,
                                     api_keys=read_api_keys(api_key, api_key_file), open_health=open_health,
                                     **({} if deadline is None else {"deadline_s": deadline}))
            _check(settings)
        except Exception as e:  # noqa: BLE001 - a pydantic or store error, said in one line
            fail(e)
        _say_who_gets_in(settings, host, port)
        os.environ[SETTINGS_ENV] = settings.model_dump_json()
        if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvrag-metrics-")
        uvicorn.run("kvrag.server.app:app_from_environment", factory=True, host=host, port=port, workers=workers,
                    timeout_graceful_shutdown=grace or None, log_level=log_level,
                    timeout_worker_healthcheck=60)  # a worker busy in a long prefill is not a dead one


def _share_signing_key(signing_key_file: str | None) -> None:
    """The workers read the key file from the environment they inherit (checked here, once)."""
    from kvrag.trust.signing import KEY_FILE_ENV, read_key_file

    if signing_key_file:
        read_key_file(signing_key_file)
        os.environ[KEY_FILE_ENV] = os.path.abspath(os.path.expanduser(signing_key_file))


def _check(settings: "ServeSettings") -> None:
    """Refuse bad tenant names and a store URL that does not open, here, once, not in every worker;
    warn when a shared store would be written under a key generated on this machine."""
    from kvrag.trust.signing import warn_if_unshared
    from kvrag.trust.tenants import check_namespace

    for entry in settings.api_keys:
        check_namespace(entry.tenant)
    if settings.store:
        from kvrag.stores import open_store

        opened = open_store(settings.store_url())
        shared = [tier.url for tier in opened.tiers]
        opened.close()
        warning = warn_if_unshared(None, shared)
        if warning:
            err.print(f"kvrag serve: WARNING: {warning}", soft_wrap=True, highlight=False)


def _say_who_gets_in(settings: "ServeSettings", host: str, port: int) -> None:
    if settings.api_keys:
        tenants = sorted({k.tenant or "(the server's own)" for k in settings.api_keys})
        err.print(f"kvrag serve: {len(settings.api_keys)} API keys for {len(tenants)} tenants: {', '.join(tenants)}")
    elif host in ("127.0.0.1", "localhost", "::1"):
        err.print(f"kvrag serve: no --api-key, so listening on {host} only (loopback): anyone on this machine "
                  "can read and write the store through it")
    else:
        err.print(f"kvrag serve: WARNING: no --api-key and listening on {host}: anyone who can reach port {port} "
                  "can read and write the store through this server; start it with --api-key")
