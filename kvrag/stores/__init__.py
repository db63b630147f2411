"""State stores, addressed by URL. `open_store("disk://PATH")` is the embedded default."""

from __future__ import annotations

from pathlib import Path

from kvrag.errors import StoreError
from kvrag.paths import kvrag_home
from kvrag.stores.base import StateStore
from kvrag.stores.disk import DiskStore
from kvrag.stores.memory import MemoryStore

__all__ = ["StateStore", "DiskStore", "MemoryStore", "open_store", "default_store_url"]


def default_store_url() -> str:
    return f"disk://{kvrag_home() / 'store'}"


def open_store(url: str | None = None) -> StateStore:
    """Open a store by URL: `disk://PATH` or `memory://`. No URL means the default disk store.

        >>> store = open_store("memory://")
    """
    url = url or default_store_url()
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise StoreError(f"store URL {url!r} has no scheme; use disk://PATH or memory://")
    if scheme == "disk":
        if not rest:
            raise StoreError("disk:// needs a folder, e.g. disk:///var/cache/kvrag or disk://./states")
        return DiskStore(Path(rest))
    if scheme == "memory":
        return MemoryStore()
    raise StoreError(f"unsupported store scheme {scheme!r} in {url!r}; use disk://PATH or memory://")
