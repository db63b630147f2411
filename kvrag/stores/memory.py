"""A store in this process's memory: for tests, benchmarks and short-lived engines."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

from kvrag.stores.base import BlobStore, StateStore, StoredState, check_blob_name, check_key

__all__ = ["MemoryStore"]


class MemoryStore(StateStore, BlobStore):
    def __init__(self) -> None:
        self.url = "memory://"
        self._states: dict[str, tuple[bytes, bytes]] = {}
        self._lock = threading.Lock()
        self._blobs: dict[str, tuple[bytes, float | None]] = {}

    def read(self, key: str, check: Callable[[bytes], Any] | None = None) -> StoredState | None:
        state = self._states.get(check_key(key))
        if state is None:
            return None
        manifest, payload = state
        return StoredState(manifest, payload, check(manifest) if check else None)

    def read_manifest(self, key: str) -> bytes | None:
        state = self._states.get(check_key(key))
        return state[0] if state else None

    def put(self, key: str, manifest: bytes, payload: Any) -> None:
        with self._lock:
            self._states[check_key(key)] = (bytes(manifest), bytes(payload))

    def delete(self, key: str) -> None:
        with self._lock:
            self._states.pop(check_key(key), None)

    def keys(self) -> Iterator[str]:
        return iter(list(self._states))

    def get_blob(self, name: str) -> bytes | None:
        entry = self._blobs.get(check_blob_name(name))
        if entry is None or (entry[1] is not None and entry[1] < time.monotonic()):
            return None
        return entry[0]

    def put_blob(self, name: str, data: bytes, *, ttl: int | None = None) -> None:
        with self._lock:
            self._blobs[check_blob_name(name)] = (bytes(data), time.monotonic() + ttl if ttl else None)

    def delete_blob(self, name: str) -> None:
        with self._lock:
            self._blobs.pop(check_blob_name(name), None)

    def blob_names(self, namespace: str) -> Iterator[str]:
        return iter([n for n in list(self._blobs) if n.startswith(namespace + "/") and self.get_blob(n) is not None])
