"""The store interface: bytes in, bytes out. Stores never see tensors."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any, Iterator

from kvrag.errors import StoreError

__all__ = ["StateStore", "check_key", "check_blob_name"]

_KEY = re.compile(r"^[0-9a-f]{64}$")
_BLOB = re.compile(r"^[A-Za-z0-9_.-]{1,64}/[0-9a-f]{64}$")


def check_blob_name(name: str) -> str:
    """Blob names are `namespace/<64 hex>`: safe as file names and Redis keys alike."""
    if not isinstance(name, str) or not _BLOB.match(name):
        raise StoreError(f"invalid blob name {name!r}: expected namespace/<64 hex characters>")
    return name


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.match(key):
        raise StoreError(f"invalid state key {key!r}: expected 64 lowercase hex characters")
    return key


class StateStore(ABC):
    """Where states live. A state is a manifest plus a payload under one key.

    `put` writes the payload first and the manifest last, so a reader that finds a manifest also
    finds its payload. A missing part is a miss (`None`), never an exception; corrupt bytes are
    returned as they are and rejected by the caller's digest checks.
    """

    url: str

    @abstractmethod
    def get_manifest(self, key: str) -> bytes | None: ...

    @abstractmethod
    def get_payload(self, key: str) -> Any | None:
        """The payload as an object with the buffer protocol, ideally without a copy."""

    @abstractmethod
    def put(self, key: str, manifest: bytes, payload: bytes) -> None: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def keys(self) -> Iterator[str]: ...

    # Small records beside the states (memo entries, LLM cache lines): plain GET/SET semantics.
    @abstractmethod
    def get_blob(self, name: str) -> bytes | None: ...

    @abstractmethod
    def put_blob(self, name: str, data: bytes, *, ttl: int | None = None) -> None: ...

    @abstractmethod
    def delete_blob(self, name: str) -> None: ...

    @abstractmethod
    def blob_names(self, namespace: str) -> Iterator[str]: ...

    @property
    def tiers(self) -> list["StateStore"]:
        """The tiers to read, hot first: a single store is its own only tier."""
        return [self]

    def __contains__(self, key: str) -> bool:
        return self.get_manifest(key) is not None

    def close(self) -> None:
        """Release connections or file handles; the default has none."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
