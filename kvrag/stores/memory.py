"""A store in this process's memory: for tests, benchmarks and short-lived engines."""

from __future__ import annotations

import threading
from typing import Iterator

from kvrag.stores.base import StateStore, check_key

__all__ = ["MemoryStore"]


class MemoryStore(StateStore):
    def __init__(self) -> None:
        self.url = "memory://"
        self._states: dict[str, tuple[bytes, bytes]] = {}
        self._lock = threading.Lock()

    def get_manifest(self, key: str) -> bytes | None:
        state = self._states.get(check_key(key))
        return state[0] if state else None

    def get_payload(self, key: str) -> bytes | None:
        state = self._states.get(check_key(key))
        return state[1] if state else None

    def put(self, key: str, manifest: bytes, payload: bytes) -> None:
        with self._lock:
            self._states[check_key(key)] = (bytes(manifest), bytes(payload))

    def delete(self, key: str) -> None:
        with self._lock:
            self._states.pop(check_key(key), None)

    def keys(self) -> Iterator[str]:
        return iter(list(self._states))
