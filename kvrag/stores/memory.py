"""A store in this process's memory: for tests, benchmarks, short-lived engines, and the bounded
hot tier of a server worker (`memory://?max_mib=512`: once states and blobs together pass the cap,
entries are dropped, least recently used first or, with `&evict=value`, least used first:
`kvrag.stores.capacity`)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Iterator

from kvrag.artifacts.digests import CheckedBuffer, HeldBytes
from kvrag.errors import StoreError
from kvrag.stores.base import BlobStore, ManifestAcceptance, StateStore, StoredState, check_blob_name, check_key
from kvrag.stores.capacity import DEFAULT_HALF_LIFE_S, Eviction, Uses, capacity_params

__all__ = ["MemoryStore"]

_MIB = 1 << 20

#: the query parameters its URL takes, besides those every tier takes
PARAMS = ("max_mib", "evict", "half_life_s")


class MemoryStore(StateStore, BlobStore):
    """States and blobs in dicts. With `max_bytes`, bounded: every read is a use of an entry, and
    every write drops entries in `eviction` order until the total fits (an entry larger than the
    cap is not kept at all; the tiers behind it still have it)."""

    def __init__(self, max_bytes: int | None = None, *, eviction: Eviction = "lru",
                 half_life_s: float = DEFAULT_HALF_LIFE_S) -> None:
        if max_bytes is not None and max_bytes < 1:
            raise StoreError("a memory store's cap must be at least one byte (memory://?max_mib=512)")
        self.max_bytes = max_bytes
        self.uses = Uses(eviction, half_life_s)
        self.url = "memory://" if max_bytes is None else f"memory://?max_mib={max_bytes / _MIB:g}" + (
            "&evict=value" if eviction == "value" else "")
        self._lock = threading.Lock()
        # ("state", key) -> (manifest, payload); ("blob", name) -> (data, expiry)
        self._entries: OrderedDict[tuple[str, str], tuple[bytes, Any]] = OrderedDict()
        self.bytes_held = 0
        self.evictions = 0

    @classmethod
    def from_params(cls, params: dict[str, str]) -> "MemoryStore":
        """From a URL's query (`max_mib`, `evict`, `half_life_s`), e.g. `memory://?max_mib=512&evict=value`."""
        unknown = set(params) - set(PARAMS)
        if unknown:
            raise StoreError(f"memory:// takes only ?max_mib=N&evict=lru|value&half_life_s=S, not {', '.join(sorted(unknown))}")
        max_bytes, eviction, half_life_s = capacity_params(params, size_name="max_mib")
        return cls(max_bytes, eviction=eviction, half_life_s=half_life_s)

    # ---------------------------------------------------------------- the bound
    def _get(self, entry: tuple[str, str]) -> tuple[bytes, Any] | None:
        with self._lock:
            value = self._entries.get(entry)
            if value is not None and self.max_bytes is not None:
                self._entries.move_to_end(entry)  # the dict's order is the order of last use
                self.uses.hit(entry)
            return value

    def _set(self, entry: tuple[str, str], value: tuple[bytes, Any], size: int) -> None:
        with self._lock:
            self._drop(entry, forget=False)  # a rewrite keeps the entry's hits
            if self.max_bytes is not None:
                if size > self.max_bytes:
                    self.uses.forget(entry)
                    return
                if self.bytes_held + size > self.max_bytes:
                    self._evict(self.max_bytes - size)
                self.uses.hit(entry)
            self._entries[entry] = value
            self.bytes_held += size

    def _evict(self, fit: int) -> None:
        """Drop entries, first to go first, until at most `fit` bytes are held."""
        for victim in self.uses.order((e, rank) for rank, e in enumerate(self._entries)):
            if self.bytes_held <= fit:
                return
            self._drop(victim)  # type: ignore[arg-type]
            self.evictions += 1

    def _drop(self, entry: tuple[str, str], *, forget: bool = True) -> None:
        value = self._entries.pop(entry, None)
        if forget:
            self.uses.forget(entry)
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
