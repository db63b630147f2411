"""The connector's settings (vLLM's `kv_connector_extra_config`), the engine fingerprint that a
stored block's bytes are valid under, and the namespace a request's `cache_salt` selects.

Both sides of the connector (vLLM's scheduler and its worker) compute the same fingerprint from
the same configuration: what it names is what the bytes of a block depend on.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvrag.models import folder_weights_sha256, hardware_fingerprint
from kvrag.paged import BlockEngine
from kvrag.stores import DEFAULT_DEADLINE_S, StateStore, default_store_url, open_store
from kvrag.trust import check_namespace, read_key_file

__all__ = ["ConnectorSettings", "block_engine", "namespace_of", "shared_store"]

_STORES: dict[str, StateStore] = {}
_STORES_LOCK = threading.Lock()


@dataclass(frozen=True)
class ConnectorSettings:
    """What `kv_connector_extra_config` may set.

    - `store`: a kvrag store URL (`memory://`, `disk://PATH`, `redis://...`, `redis+cluster://...`,
      tiers as a comma list, `?max_gib=`); kvrag's default disk store if unset.
    - `signing_key_file`: the key file every process sharing the store reads; else kvrag's key
      (`KVRAG_SIGNING_KEY`, `KVRAG_SIGNING_KEY_FILE`, the user's key file).
    - `namespace`: the tenant every request of this server belongs to (a request's `cache_salt`
      selects a tenant within it).
    - `deadline_s`: how long a request's store lookups at scheduling may take, and then its block
      reads: a block not read in time is computed instead.
    """

    store: str
    signing_key: bytes | None = None
    namespace: str = ""
    deadline_s: float = DEFAULT_DEADLINE_S

    #: the keys `kv_connector_extra_config` may hold
    KEYS = ("store", "signing_key_file", "namespace", "deadline_s")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> "ConnectorSettings":
        unknown = sorted(set(extra) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"kvrag connector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(cls.KEYS)}")
        key_file = extra.get("signing_key_file")
        return cls(
            store=str(extra.get("store") or default_store_url()),
            signing_key=read_key_file(str(key_file)) if key_file else None,
            namespace=check_namespace(str(extra.get("namespace", ""))),
            deadline_s=float(extra.get("deadline_s", DEFAULT_DEADLINE_S)),
        )


def shared_store(url: str) -> StateStore:
    """One opened store per URL in this process: vLLM's scheduler and worker sides share it (a
    `memory://` store is only shared that way)."""
    with _STORES_LOCK:
        if url not in _STORES:
            _STORES[url] = open_store(url)
        return _STORES[url]


def namespace_of(base: str, cache_salt: str | None) -> str:
    """The kvrag namespace of a request: the server's, or within it the tenant its `cache_salt`
    names (a digest of the salt: any string is a valid salt, and the salt itself is not stored)."""
    if not cache_salt:
        return base
    salt = "salt-" + hashlib.sha256(cache_salt.encode()).hexdigest()[:40]
    return f"{base[:18]}.{salt}" if base else salt


def _model_identity(model: str, revision: str | None) -> dict[str, str]:
    folder = Path(model)
    if folder.is_dir():
        return {"model_weights_sha256": folder_weights_sha256(folder)}
    return {"model": model, "model_revision": revision or ""}


def block_engine(vllm_config: Any) -> BlockEngine:
    """The fingerprint of what a block's bytes depend on: vLLM's version, the model's weights,
    dtype, KV cache dtype and block size, the attention backend and layout, the parallel layout,
    and the hardware and kernels (kvrag's hardware fingerprint, the CPU threads vLLM binds)."""
    import vllm

    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    attention = getattr(vllm_config, "attention_config", None)
    hardware = hardware_fingerprint(vllm_config.device_config.device_type, threads_matter=False)
    return BlockEngine({
        "format": "vllm-kv-block/1",
        "vllm": vllm.__version__,
        **_model_identity(str(model.model), getattr(model, "revision", None)),
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(cache.cache_dtype),
        "block_size": str(cache.block_size),
        "attention_backend": str(getattr(attention, "backend", None) or "auto"),
        "kv_cache_layout": str(os.environ.get("VLLM_KV_CACHE_LAYOUT", "")),
        "tensor_parallel_size": str(parallel.tensor_parallel_size),
        "pipeline_parallel_size": str(parallel.pipeline_parallel_size),
        "hardware": hardware.digest,
        "torch": torch.__version__,
        "cpu_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""),
    })
