"""What one `kvrag serve` worker is started with: its model, store, admission limits and API keys."""

from __future__ import annotations

import os

from pydantic import BaseModel, Field

from kvrag.stores.deadline import DEFAULT_DEADLINE_S

__all__ = ["ApiKey", "ServeSettings", "SETTINGS_ENV"]

#: The environment variable that carries `ServeSettings` (JSON) to uvicorn's worker processes.
SETTINGS_ENV = "KVRAG_SERVE_SETTINGS"


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
    #: generations run at once per worker: the rows of its decoding batch
    concurrency: int = Field(default=16, ge=1, le=64)
    #: the generations' decoding steps share one forward (`kvrag.core.batching`); off: each its own,
    #: on its own share of the cores
    batch: bool = True
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
        slow every forward down. With the batch, a worker runs one forward at a time."""
        return self.threads or max(1, (os.cpu_count() or 1) // (self.workers * (1 if self.batch else self.concurrency)))
