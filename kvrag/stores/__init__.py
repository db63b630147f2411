"""State stores, addressed by URL. `open_store("disk://PATH")` is the embedded default.

    disk://PATH                         atomic files (the default, in the user cache dir); ?max_gib=N caps it
    memory://                           this process only; ?max_mib=N caps it (kvrag.stores.capacity)
    redis://[user:pass@]host:port/db    one Redis server; rediss:// for TLS
    redis+cluster://host:port,...       Redis Cluster (a state's frames share one hash slot);
                                        rediss+cluster:// or ?ssl=true for TLS (TLS or refused)
    redis://...,disk://...              tiers, hot first: reads promote, writes go through

Every tier URL also takes `?namespace=NAME` (the tenant: part of every state and memo key),
`?allow_unsigned=1` (read unsigned states, warned once) and `?confidential=1` (what is written
there is encrypted under the tenant's key: `kvrag.trust.confidential`).
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import parse_qsl, urlencode

from kvrag.errors import StoreError
from kvrag.paths import kvrag_home
from kvrag.stores.base import (
    UNTRUSTED_PARSE_ERRORS,
    Acceptance,
    Accepted,
    BlobStore,
    Found,
    ManifestAcceptance,
    PayloadChunking,
    StateStore,
    StoredState,
    shorten,
)
from kvrag.stores.deadline import DEFAULT_DEADLINE_S, Breaker, Deadline
from kvrag.stores.disk import DiskStore
from kvrag.stores.memory import MemoryStore
from kvrag.stores.redis import RedisStore, redis_store_from_url
from kvrag.stores.tiered import TieredStore

__all__ = ["UNTRUSTED_PARSE_ERRORS", "StateStore", "BlobStore", "StoredState", "Acceptance", "Accepted", "ManifestAcceptance",
           "PayloadChunking", "Found", "Deadline", "Breaker", "DEFAULT_DEADLINE_S", "DiskStore", "MemoryStore", "RedisStore",
           "TieredStore", "open_store", "default_store_url"]

_SCHEMES = "disk://PATH, memory://, redis://, rediss://, redis+cluster://, rediss+cluster://, or a comma list of them"


def default_store_url() -> str:
    return f"disk://{kvrag_home() / 'store'}"


def open_store(url: str | None = None, *, write: Literal["all", "hot"] = "all") -> StateStore:
    """Open a store by URL; a comma list opens tiers, hot first. No URL means the default disk store.

        >>> store = open_store("memory://")
        >>> tiers = open_store("redis://127.0.0.1:6379/0,disk:///tmp/kvrag")  # no I/O until used
    """
    url = url or default_store_url()
    parts = _split_tiers(url)
    if len(parts) > 1:
        return TieredStore([_open_one(p) for p in parts], write=write)
    return _open_one(parts[0])


def _split_tiers(url: str) -> list[str]:
    """Split on commas that start a new URL (a cluster URL has commas between its hosts)."""
    pieces: list[str] = []
    for piece in url.split(","):
        if "://" in piece or not pieces:
            pieces.append(piece.strip())
        else:
            pieces[-1] += "," + piece.strip()
    return [p for p in pieces if p]


#: the query parameters every tier's URL takes
COMMON_PARAMS = ("namespace", "allow_unsigned", "confidential")


def _open_one(url: str) -> StateStore:
    url, common = _common_params(url)
    store = _open_scheme(url)
    store.namespace = common.get("namespace", "")
    store.allow_unsigned = _flag(common, "allow_unsigned")
    store.confidential = _flag(common, "confidential")
    return store


def _flag(params: dict[str, str], name: str) -> bool:
    value = params.get(name, "0").lower()
    if value not in ("0", "1", "true", "false", "yes", "no", ""):
        raise StoreError(f"?{name}= takes 1 or 0, not {shorten(value)}")
    return value in ("1", "true", "yes")


def _common_params(url: str) -> tuple[str, dict[str, str]]:
    """`url` without the parameters every scheme takes, and those parameters."""
    base, sep, query = url.partition("?")
    if not sep:
        return url, {}
    kept, common = [], {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        (common.__setitem__(name, value) if name in COMMON_PARAMS else kept.append((name, value)))
    namespace = common.get("namespace", "")
    if namespace and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", namespace):
        raise StoreError("namespace may hold 1 to 64 letters, digits and _ . -")
    return base + ("?" + urlencode(kept) if kept else ""), common


def _open_scheme(url: str) -> StateStore:
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise StoreError(f"store URL {url!r} has no scheme; use {_SCHEMES}")
    if scheme == "disk":
        return DiskStore.from_url_rest(rest)
    if scheme == "memory":
        base, _, query = rest.partition("?")
        if base.strip("/"):
            raise StoreError(f"memory:// takes no path, only ?max_mib=N; got {url!r}")
        return MemoryStore.from_params(dict(parse_qsl(query, keep_blank_values=True)))
    if scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        return redis_store_from_url(url)
    raise StoreError(f"unsupported store scheme {scheme!r} in {url!r}; use {_SCHEMES}")
