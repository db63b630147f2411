"""The store interface: bytes in, bytes out. Stores never see tensors."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any, Iterator

from kvrag.errors import StoreError

__all__ = ["StateStore", "check_key"]

_KEY = re.compile(r"^[0-9a-f]{64}$")


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

    def __contains__(self, key: str) -> bool:
        return self.get_manifest(key) is not None

    def close(self) -> None:
        """Release connections or file handles; the default has none."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
