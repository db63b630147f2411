"""The store interfaces: bytes in, bytes out. Stores never see tensors.

`StateStore` holds states (a manifest and a payload under one key); `BlobStore` holds small
records beside them (memo entries, cache lines). A read hands back a manifest and the payload of
the same write together (`read`), so no reader can pair a manifest with another write's payload.
`fetch` is a read through the store's checks: the caller's `Acceptance` sees the manifest before
any payload byte is read, then the payload; a tiered store walks its tiers with it (see
`kvrag.stores.tiered`).
"""

from __future__ import annotations

import re
import struct
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, Protocol, Sequence, TypeVar

from kvrag.artifacts.digests import CHUNK_BYTES, PayloadChunking
from kvrag.errors import (
    IntegrityError,
    StateError,
    StateNotFoundError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from kvrag.stores import outages
from kvrag.stores.deadline import Breaker, Deadline, bounded

__all__ = ["StateStore", "BlobStore", "StoredState", "Acceptance", "Accepted", "ManifestAcceptance", "PayloadChunking", "Receive", "Found", "check_key", "check_blob_name",
           "UNTRUSTED_PARSE_ERRORS", "shorten"]

_KEY = re.compile(r"[0-9a-f]{64}")
#: a namespace never starts with a dot (no `.`, `..` or hidden names: a blob never leaves its folder)
_BLOB = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}/[0-9a-f]{64}")

T = TypeVar("T")

#: What a parser of untrusted bytes may raise besides kvrag's own errors; any of them, raised while
#: reading or checking stored bytes, is an `IntegrityError` (the next tier or the text answers).
UNTRUSTED_PARSE_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, TypeError, LookupError, ArithmeticError, AttributeError, RecursionError, MemoryError, struct.error,
)
T_co = TypeVar("T_co", covariant=True)


def shorten(text: object, limit: int = 24) -> str:
    """`text` for an error message: at most `limit` characters of it, quoted."""
    text = str(text)
    return repr(text if len(text) <= limit else text[:limit] + "...")


def check_blob_name(name: str) -> str:
    """Blob names are `namespace/<64 hex>`: safe as file names and Redis keys alike."""
    if not isinstance(name, str) or not _BLOB.fullmatch(name):
        raise StoreError(f"invalid blob name {shorten(name)}: expected namespace/<64 hex characters>, the "
                         "namespace of letters, digits and _ . - not starting with a dot")
    return name


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise StoreError(f"invalid state key {shorten(key)}: expected 64 lowercase hex characters")
    return key


@dataclass(frozen=True)
class Accepted:
    """What a reader's manifest acceptance returned: its own value (handed to its payload check) and
    the payload chunking it vouches for (None: the store reads the payload as it is, unchecked)."""

    value: Any
    chunking: PayloadChunking | None = None


#: A manifest acceptance as a store's `read` takes it: raw manifest bytes in, `Accepted` out (or raise).
ManifestAcceptance = Callable[[bytes], Accepted]


@dataclass(frozen=True)
class StoredState:
    """A manifest and the payload written with it. `payload` has the buffer protocol (often a view
    over a mapping or a received buffer: no copy); `accepted` is what the read's acceptance returned."""

    manifest: bytes
    payload: Any
    accepted: Accepted | None = None


class Acceptance(Protocol[T_co]):
    """What a reader accepts. Raise a `StateError` from either method to refuse the state."""

    def manifest(self, raw: bytes, store: "StateStore") -> Accepted:
        """Check manifest bytes (read from `store`) before any payload byte is read; the result's
        `value` goes to `payload`, its `chunking` tells the store how to read and check the payload."""

    def payload(self, manifest: Any, payload: Any) -> T_co:
        """Check the payload against the checked manifest; the result is what `fetch` returns."""


@dataclass(frozen=True)
class Receive:
    """One state to read into the caller's memory (`RedisStore.receive_run`): its key, what
    accepts it, and the bytes its payload goes into (writable byte views, filled in order, together
    exactly the payload's size)."""

    key: str
    acceptance: Acceptance[Any]
    pieces: Sequence[memoryview]


@dataclass(frozen=True)
class Found(Generic[T]):
    """A state that passed its checks, the tier that served it, and why hotter tiers did not."""

    value: T
    tier: str
    stored: StoredState = field(repr=False)
    #: the errors of the hotter tiers that did not serve it (each names its `tier`)
    misses: tuple[StateError, ...] = ()

    @property
    def notes(self) -> str | None:
        """The misses as one line for a receipt (None when the hottest tier served it)."""
        return "; ".join(f"{e.tier}: {e.reason}: {e}" for e in self.misses) or None


class Guarded:
    """A tier's breaker, and reads bounded by a question's deadline that trip it."""

    url: str

    @property
    def breaker(self) -> Breaker:
        """This tier's breaker: open after a read timed out or the tier could not be reached."""
        if "_breaker" not in self.__dict__:
            breaker = self.make_breaker()
            breaker.name = breaker.name or getattr(self, "url", "")
            self.__dict__["_breaker"] = breaker
        return self.__dict__["_breaker"]

    def make_breaker(self) -> Breaker:
        """This tier's breaker, made on first use (a tier with a liveness probe makes a half-open one)."""
        return Breaker()

    def guarded(self, fn: Callable[[], T], deadline: Deadline | None, what: str) -> T:
        """`fn()` unless the breaker is open, waited for until `deadline`; a timeout or a store
        failure opens the breaker and is a `StoreUnavailableError`."""
        if self.breaker.is_open:
            raise StoreUnavailableError(f"{self.url} skipped: {self.breaker.why}", tier=self.url)
        if deadline is not None and deadline.expired:  # spent by other tiers: not this tier's fault
            raise StoreTimeoutError(f"{what}: the question's {deadline.seconds:g} s for store reads was spent",
                                    tier=self.url)
        try:
            result = bounded(fn, deadline, what)
        except StoreTimeoutError as e:
            self.breaker.trip(f"timed out at {time.strftime('%H:%M:%S')}: {e}")
            e.located(tier=self.url)
            raise
        except StoreUnavailableError as e:
            self.breaker.trip(f"failed at {time.strftime('%H:%M:%S')}: {e}")
            e.located(tier=self.url)
            raise
        except StoreError as e:
            self.breaker.trip(f"failed at {time.strftime('%H:%M:%S')}: {e}")
            raise StoreUnavailableError(str(e), tier=self.url) from e
        outages.answered(self.url)
        return result


class StateStore(Guarded, ABC):
    """Where states live. A state is a manifest plus a payload under one key.

    `put` writes the payload first and the manifest last, so a reader that finds a manifest also
    finds its payload. A missing part is a miss (`None`), never an exception; corrupt bytes are
    returned as they are and rejected by the caller's checks.
    """

    url: str
    #: states read from this store may be unsigned (`?allow_unsigned=1`); a warning is logged once
    allow_unsigned: bool = False
    #: the tenant whose states this store holds (`?namespace=`); part of every state and memo key
    namespace: str = ""
    #: what an engine writes here is encrypted under its tenant's key (`?confidential=1`)
    confidential: bool = False
    #: the chunk size (each chunk with its own SHA-256) of states deposited through this store; a
    #: Redis tier stores one frame per chunk
    chunk_bytes: int = CHUNK_BYTES

    @abstractmethod
    def read(self, key: str, accept: ManifestAcceptance | None = None) -> StoredState | None:
        """The manifest and payload of one write, or None. `accept(manifest)` runs before the payload
        is read; what it raises propagates, what it returns is `StoredState.checked`. When that
        carries a `PayloadChunking`, the payload is read to it and checked chunk by chunk as it
        arrives (a payload of another size is an `IntegrityError`)."""

    @abstractmethod
    def read_manifest(self, key: str) -> bytes | None:
        """The manifest alone (cheap: for listings and `deposited`); never pair it with a later read."""

    @abstractmethod
    def put(self, key: str, manifest: bytes, payload: Any) -> None: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def keys(self) -> Iterator[str]: ...

    def _holds(self, key: str) -> bool:
        """Whether the manifest and every part of its payload are present (nothing is hashed); each
        store says so its own way, unguarded: callers ask `holds`."""
        return self.read_manifest(key) is not None

    def holds(self, key: str, deadline: Deadline | None = None) -> bool:
        """Whether this store holds the state under `key` whole, manifest and every part of its
        payload (nothing is hashed), through this tier's guard: within `deadline`, skipped while the
        breaker is open; a tier that fails to answer in time, or whose stored bytes do not parse,
        counts as not holding it (never an error: callers only decide whether to read or deposit)."""
        try:
            return self.guarded(lambda: self._holds(key), deadline, f"checking {key[:12]} in {self.url}")
        except (StoreError, StateError, *UNTRUSTED_PARSE_ERRORS):
            return False

    def holds_run(self, keys: Sequence[str], deadline: Deadline | None = None) -> int:
        """How many of `keys`, from the first, this store holds whole (as `holds` says), within
        `deadline`; a store that can asks for them all at once."""
        for count, key in enumerate(keys):
            if not self.holds(key, deadline):
                return count
        return len(keys)

    @property
    def tiers(self) -> list["StateStore"]:
        """The tiers to read, hot first: a single store is its own only tier."""
        return [self]

    def fetch(self, key: str, acceptance: Acceptance[T], deadline: Deadline | None = None) -> Found[T]:
        """The state under `key` if `acceptance` accepts it, read within `deadline`; raises the
        `StateError` that says why not: an absent key is a `StateNotFoundError`; a store failure,
        a read past the deadline or an open breaker a `StoreUnavailableError`; stored bytes that
        do not parse, whatever the parser raised, an `IntegrityError`."""
        def read_and_check() -> Found[T]:
            stored = self.read(key, lambda raw: acceptance.manifest(raw, self))
            if stored is None:
                raise StateNotFoundError(f"no state {key[:12]} (or a part of it) in {self.url}")
            value = stored.accepted.value if stored.accepted is not None else None
            return Found(acceptance.payload(value, stored.payload), self.url, stored)

        try:
            return self.guarded(read_and_check, deadline, f"reading {key[:12]} from {self.url}")
        except StateError as e:
            e.located(key, self.url)
            raise
        except UNTRUSTED_PARSE_ERRORS as e:
            raise IntegrityError(f"state {key[:12]} in {self.url} does not parse: {type(e).__name__}: "
                                 f"{str(e)[:200]}", key=key, tier=self.url) from e

    def __contains__(self, key: str) -> bool:
        """`key in store`: `holds(key)`."""
        return self.holds(key)

    def close(self) -> None:
        """Release connections or file handles; the default has none."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class BlobStore(Guarded, ABC):
    """Small records beside the states (memo entries, LLM cache lines): plain GET/SET semantics."""

    def fetch_blob(self, name: str, deadline: Deadline | None = None) -> bytes | None:
        """`get_blob` within `deadline`, skipped while the breaker is open (`StoreUnavailableError`)."""
        return self.guarded(lambda: self.get_blob(name), deadline, f"reading {name} from {self.url}")

    @abstractmethod
    def get_blob(self, name: str) -> bytes | None: ...

    @abstractmethod
    def put_blob(self, name: str, data: bytes, *, ttl: int | None = None) -> None: ...

    @abstractmethod
    def delete_blob(self, name: str) -> None: ...

    @abstractmethod
    def blob_names(self, namespace: str) -> Iterator[str]: ...
