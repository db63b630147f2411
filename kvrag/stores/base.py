"""The store interfaces: bytes in, bytes out. Stores never see tensors.

`StateStore` holds states (a manifest and a payload under one key); `BlobStore` holds small
records beside them (memo entries, cache lines). A read hands back a manifest and the payload of
the same write together (`read`), so no reader can pair a manifest with another write's payload.
`fetch` is a read through the store's checks: the caller's `StateCheck` sees the manifest before
any payload byte is read, then the payload; a tiered store walks its tiers with it (see
`kvrag.stores.tiered`).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, Protocol, TypeVar

from kvrag.errors import StateError, StateNotFoundError, StoreError, StoreUnavailableError

__all__ = ["StateStore", "BlobStore", "StoredState", "StateCheck", "Found", "check_key", "check_blob_name"]

_KEY = re.compile(r"^[0-9a-f]{64}$")
_BLOB = re.compile(r"^[A-Za-z0-9_.-]{1,64}/[0-9a-f]{64}$")

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


def check_blob_name(name: str) -> str:
    """Blob names are `namespace/<64 hex>`: safe as file names and Redis keys alike."""
    if not isinstance(name, str) or not _BLOB.match(name):
        raise StoreError(f"invalid blob name {name!r}: expected namespace/<64 hex characters>")
    return name


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.match(key):
        raise StoreError(f"invalid state key {key!r}: expected 64 lowercase hex characters")
    return key


@dataclass(frozen=True)
class StoredState:
    """A manifest and the payload written with it. `payload` has the buffer protocol (often a view
    over a mapping or a received buffer: no copy); `checked` is what the read's check returned."""

    manifest: bytes
    payload: Any
    checked: Any = None


class StateCheck(Protocol[T_co]):
    """What a reader accepts. Raise a `StateError` from either method to refuse the state."""

    def manifest(self, raw: bytes) -> Any:
        """Check manifest bytes before any payload byte is read; the result goes to `payload`."""

    def payload(self, manifest: Any, payload: Any) -> T_co:
        """Check the payload against the checked manifest; the result is what `fetch` returns."""


@dataclass(frozen=True)
class Found(Generic[T]):
    """A state that passed its checks, the tier that served it, and why hotter tiers did not."""

    value: T
    tier: str
    stored: StoredState = field(repr=False)
    misses: tuple[tuple[str, StateError], ...] = ()

    @property
    def notes(self) -> str | None:
        """The misses as one line for a receipt (None when the hottest tier served it)."""
        return "; ".join(f"{url}: {e.reason}: {e}" for url, e in self.misses) or None


class StateStore(ABC):
    """Where states live. A state is a manifest plus a payload under one key.

    `put` writes the payload first and the manifest last, so a reader that finds a manifest also
    finds its payload. A missing part is a miss (`None`), never an exception; corrupt bytes are
    returned as they are and rejected by the caller's checks.
    """

    url: str

    @abstractmethod
    def read(self, key: str, check: Callable[[bytes], Any] | None = None) -> StoredState | None:
        """The manifest and payload of one write, or None. `check(manifest)` runs before the payload
        is read; what it raises propagates, what it returns is `StoredState.checked`."""

    @abstractmethod
    def read_manifest(self, key: str) -> bytes | None:
        """The manifest alone (cheap: for listings and `deposited`); never pair it with a later read."""

    @abstractmethod
    def put(self, key: str, manifest: bytes, payload: Any) -> None: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def keys(self) -> Iterator[str]: ...

    @property
    def tiers(self) -> list["StateStore"]:
        """The tiers to read, hot first: a single store is its own only tier."""
        return [self]

    def fetch(self, key: str, check: StateCheck[T]) -> Found[T]:
        """The state under `key` if it passes `check`; raises the `StateError` that says why not
        (a store failure is a `StoreUnavailableError`, an absent key a `StateNotFoundError`)."""
        try:
            stored = self.read(key, check.manifest)
        except StoreError as e:
            raise StoreUnavailableError(str(e)) from e
        if stored is None:
            raise StateNotFoundError(f"no state {key[:12]} (or a part of it) in {self.url}")
        return Found(check.payload(stored.checked, stored.payload), self.url, stored)

    def __contains__(self, key: str) -> bool:
        return self.read_manifest(key) is not None

    def close(self) -> None:
        """Release connections or file handles; the default has none."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class BlobStore(ABC):
    """Small records beside the states (memo entries, LLM cache lines): plain GET/SET semantics."""

    @abstractmethod
    def get_blob(self, name: str) -> bytes | None: ...

    @abstractmethod
    def put_blob(self, name: str, data: bytes, *, ttl: int | None = None) -> None: ...

    @abstractmethod
    def delete_blob(self, name: str) -> None: ...

    @abstractmethod
    def blob_names(self, namespace: str) -> Iterator[str]: ...
