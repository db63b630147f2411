"""A store in this process's memory: for tests, benchmarks, short-lived engines, and the bounded
hot tier of a server worker (`memory://?max_mib=512`: least recently used entries are dropped
once states and blobs together pass the cap)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Iterator

from kvrag.artifacts.digests import CheckedBuffer, HeldBytes
from kvrag.errors import StoreError
from kvrag.stores.base import BlobStore, ManifestAcceptance, StateStore, StoredState, check_blob_name, check_key

__all__ = ["MemoryStore"]

_MIB = 1 << 20


class MemoryStore(StateStore, BlobStore):
    """States and blobs in dicts. With `max_bytes`, an LRU: every read refreshes an entry, every
    write drops the least recently used until the total fits (an entry larger than the cap is not
    kept at all; the tiers behind it still have it)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 1:
            raise StoreError("a memory store's cap must be at least one byte (memory://?max_mib=512)")
        self.max_bytes = max_bytes
        self.url = "memory://" if max_bytes is None else f"memory://?max_mib={max_bytes / _MIB:g}"
        self._lock = threading.Lock()
        # ("state", key) -> (manifest, payload); ("blob", name) -> (data, expiry)
        self._entries: OrderedDict[tuple[str, str], tuple[bytes, Any]] = OrderedDict()
        self.bytes_held = 0
        self.evictions = 0

    @classmethod
    def from_params(cls, params: dict[str, str]) -> "MemoryStore":
        """From a URL's query (`max_mib`), e.g. `memory://?max_mib=512`."""
        unknown = set(params) - {"max_mib"}
        if unknown:
            raise StoreError(f"memory:// takes only ?max_mib=N, not {', '.join(sorted(unknown))}")
        if "max_mib" not in params:
            return cls()
        try:
            mib = float(params["max_mib"])
        except ValueError:
            raise StoreError(f"max_mib must be a number of MiB, not {params['max_mib']!r}") from None
        if not 0 < mib <= 1 << 30:
            raise StoreError("max_mib must be more than 0")
        return cls(max(1, int(mib * _MIB)))

    # ----------------------------------------------------------------- the LRU
    def _get(self, entry: tuple[str, str]) -> tuple[bytes, Any] | None:
        with self._lock:
            value = self._entries.get(entry)
            if value is not None and self.max_bytes is not None:
                self._entries.move_to_end(entry)
            return value

    def _set(self, entry: tuple[str, str], value: tuple[bytes, Any], size: int) -> None:
        with self._lock:
            self._drop(entry)
            if self.max_bytes is not None:
                if size > self.max_bytes:
                    return
                while self._entries and self.bytes_held + size > self.max_bytes:
                    self._drop(next(iter(self._entries)))
                    self.evictions += 1
            self._entries[entry] = value
            self.bytes_held += size

    def _drop(self, entry: tuple[str, str]) -> None:
        value = self._entries.pop(entry, None)
        if value is not None:
            self.bytes_held -= _size(entry, value)

    # ------------------------------------------------------------------ states
    def read(self, key: str, accept: ManifestAcceptance | None = None) -> StoredState | None:
        state = self._get(("state", check_key(key)))
        if state is None:
            return None
        manifest, payload = state
        return StoredState(manifest, payload, accept(manifest) if accept else None)

    def read_manifest(self, key: str) -> bytes | None:
        state = self._get(("state", check_key(key)))
        return state[0] if state else None

    def put(self, key: str, manifest: bytes, payload: Any) -> None:
        size = len(manifest) + (len(payload) if isinstance(payload, CheckedBuffer) else memoryview(payload).nbytes)
        if self.max_bytes is not None and size > self.max_bytes:
            with self._lock:
                self._drop(("state", check_key(key)))
            return
        # A payload another tier already checked (a `CheckedBuffer`, which kvrag never writes
        # into) is kept as it is: promoting a state into this tier copies nothing, and a hit
        # hashes nothing again. Other bytes are kept immutable (`HeldBytes`): checked on their
        # first read, not again on later ones.
        value = (bytes(manifest), payload if isinstance(payload, CheckedBuffer) else HeldBytes(payload))
        self._set(("state", check_key(key)), value, len(value[0]) + len(value[1]))

    def delete(self, key: str) -> None:
        with self._lock:
            self._drop(("state", check_key(key)))

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter([name for kind, name in self._entries if kind == "state"])

    # ------------------------------------------------------------------- blobs
    def get_blob(self, name: str) -> bytes | None:
        entry = self._get(("blob", check_blob_name(name)))
        if entry is None or (entry[1] is not None and entry[1] < time.monotonic()):
            return None
        return entry[0]

    def put_blob(self, name: str, data: bytes, *, ttl: int | None = None) -> None:
        value = (bytes(data), time.monotonic() + ttl if ttl else None)
        self._set(("blob", check_blob_name(name)), value, len(value[0]))

    def delete_blob(self, name: str) -> None:
        with self._lock:
            self._drop(("blob", check_blob_name(name)))

    def blob_names(self, namespace: str) -> Iterator[str]:
        with self._lock:
            names = [name for kind, name in self._entries if kind == "blob" and name.startswith(namespace + "/")]
        return iter([n for n in names if self.get_blob(n) is not None])


def _size(entry: tuple[str, str], value: tuple[bytes, Any]) -> int:
    return len(value[0]) + (len(value[1]) if entry[0] == "state" else 0)
