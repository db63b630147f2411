"""Redis and Redis Cluster tiers: a frame table plus payload frames, pipelined, hash-tagged.

Keys for a state `K` are `PREFIX:{K}:m` (the frame table) and `PREFIX:{K}:f:<payload id>:<i>`
(its frames). The `{K}` hash tag puts them all in one cluster slot, so one MGET fetches a whole
state on a single node. Every Redis failure surfaces as `StoreError`, which the engine treats as a
miss in this tier: the next tier or a text re-prefill answers instead.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any, Callable, Iterator

from kvrag.artifacts.format import parse_manifest
from kvrag.errors import (
    RedirectError,
    StoreError,
    StoreUnavailableError,
)
from kvrag.stores.base import (
    BlobStore,
    ManifestAcceptance,
    StateStore,
    StoredState,
    check_blob_name,
    check_key,
)
from kvrag.stores.deadline import Breaker
from kvrag.stores.outages import answered, public_url
from kvrag.stores.redis.frames import DEFAULT_FRAME_BYTES, Assembler, FrameTable, parse_frame_table
from kvrag.stores.redis.runs import RunReads
from kvrag.stores.redis.wire import FramePool
from kvrag.stores.redis.writes import FrameWrites

__all__ = ["RedisStore"]

_LANES: ThreadPoolExecutor | None = None
_LANES_LOCK = threading.Lock()


def _lanes() -> ThreadPoolExecutor:
    """The threads that fetch a state's frames over several connections (shared by all stores)."""
    global _LANES
    with _LANES_LOCK:
        if _LANES is None:
            _LANES = ThreadPoolExecutor(8, thread_name_prefix="kvrag-redis-lane")
        return _LANES


_STATE_FROM_KEY = re.compile(r"\{([0-9a-f]{64})\}")


@lru_cache(maxsize=1)
def _redis_errors() -> tuple[type[BaseException], ...]:
    """Every exception redis-py defines (a cluster client's own failures are not all `RedisError`s),
    and the socket's: none of them leaves a store call but as a kvrag error."""
    import redis

    defined = (value for value in vars(redis.exceptions).values() if isinstance(value, type))
    return (*(kind for kind in defined if issubclass(kind, Exception) and kind.__module__.startswith("redis")), OSError)


def _unreachable_errors() -> tuple[type[BaseException], ...]:
    """Failures that say the server or cluster cannot serve now (they open the breaker)."""
    import redis

    # every RedisClusterException and ClusterError: no node answered, or none serves the slot yet
    return (redis.exceptions.TimeoutError, redis.exceptions.ConnectionError, redis.exceptions.RedisClusterException,
            redis.exceptions.ClusterError, OSError)


class RedisStore(RunReads, FrameWrites, StateStore, BlobStore):
    """A tier on one Redis server or a Redis Cluster. The client is created on first use."""

    def __init__(
        self,
        client_factory: Any,
        *,
        url: str,
        prefix: str = "kvrag",
        frame_bytes: int = DEFAULT_FRAME_BYTES,
        ttl: int | None = None,
        frames_per_mget: int = 1,
        cluster: bool = False,
        max_state_bytes: int = 16 << 30,
        connections: int = 2,
        frame_pool: FramePool | None = None,
        node: tuple[str, int] | None = None,
        probe: Callable[[], bool] | None = None,
    ) -> None:
        self.url = url
        self.cluster = cluster
        self.max_state_bytes = max_state_bytes
        self.prefix = prefix
        self.frame_bytes = frame_bytes
        self.chunk_bytes = frame_bytes  # states deposited through this tier: one frame per chunk
        self.ttl = ttl
        self.frames_per_mget = frames_per_mget
        self.connections = connections
        #: frames read straight into the payload buffer over our own connections (see
        #: `kvrag.stores.redis.wire`); None: through redis-py
        self.frame_pool = frame_pool
        self._node = node
        self._client_factory = client_factory
        self._client: Any = None
        #: a PING with short timeouts on a connection of its own: whether the server is back
        self._probe = probe

    def make_breaker(self) -> Breaker:
        return Breaker(probe=self._probe)

    @property
    def client(self) -> Any:
        """The redis-py client, made on first use (a cluster's asks its nodes for the slot map)."""
        if self._client is None:
            try:
                self._client = self._client_factory()
            except _redis_errors() as e:
                raise self._failure("connecting", e) from e
            except ValueError as e:
                raise StoreError(f"cannot connect to {public_url(self.url)}: {e}") from e
        return self._client

    def _failure(self, what: str, e: BaseException) -> StoreError:
        """The kvrag error for a redis-py failure: one that says the server cannot be reached opens
        the breaker (reporting the outage once) and is a `StoreUnavailableError`."""
        message = f"{what} failed on {public_url(self.url)}: {type(e).__name__}: {e}"
        if isinstance(e, _unreachable_errors()):
            self.breaker.trip(f"{type(e).__name__} at {time.strftime('%H:%M:%S')}")
            return StoreUnavailableError(message, tier=self.url)
        return StoreError(message)

    def _skipped(self, what: str) -> StoreUnavailableError:
        return StoreUnavailableError(f"{what} skipped on {public_url(self.url)}: {self.breaker.why}", tier=self.url)

    def _mkey(self, key: str) -> str:
        return f"{self.prefix}:{{{check_key(key)}}}:m"

    def _fkeys(self, key: str, frame_table: FrameTable) -> list[str]:
        return [f"{self.prefix}:{{{key}}}:f:{frame_table.payload_id}:{i}" for i in range(len(frame_table.frames))]

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One round trip; while the breaker is open (the server just timed out or failed), none."""
        if self.breaker.is_open:
            raise self._skipped(what)
        try:
            result = fn(*args, **kwargs)
        except _redis_errors() as e:
            raise self._failure(what, e) from e
        answered(self.url)
        return result

    def get_frame_table(self, key: str) -> FrameTable | None:
        raw = self._call("GET", lambda: self.client.get(self._mkey(key)))
        return None if raw is None else parse_frame_table(raw)

    def read_manifest(self, key: str) -> bytes | None:
        frame_table = self.get_frame_table(key)
        return None if frame_table is None else frame_table.manifest.encode()

    def read(self, key: str, accept: ManifestAcceptance | None = None) -> StoredState | None:
        """The frame table, then its frames: the manifest and payload of one write, always together
        (a rewrite of the key in between leaves the old frames until gc)."""
        frame_table = self.get_frame_table(key)
        if frame_table is None:
            return None
        manifest = frame_table.manifest.encode()
        accepted = accept(manifest) if accept else None
        # The frame chunking comes from the manifest (signed, and accepted just now), never from the
        # frame table: a frame table listing anything but exactly the manifest's chunks is refused before a
        # byte is allocated.
        # (A raw read with no check, for tools, takes the frame table's chunking, bounded by max_state_bytes.)
        if accept is not None:
            vouched = accepted.chunking if accepted is not None and accepted.chunking else parse_manifest(manifest).chunking
            frame_table.check_lists(vouched, key)
        keys = self._fkeys(key, frame_table)
        chunking = accepted.chunking if accepted is not None else None
        assembler = Assembler(frame_table, self.max_state_bytes, chunking)

        def fetch(batch: list[str]) -> list[Any]:
            if self.cluster:  # a cluster pipeline refuses MGET; its GETs all go to the slot's node
                pipe = self.client.pipeline(transaction=False)
                for name in batch:
                    pipe.get(name)
                return list(pipe.execute())
            return list(self.client.mget(batch))

        if self.frame_pool is not None and keys:
            try:
                return self._read_direct(keys, assembler, manifest, accepted)
            except RedirectError:  # the slot moved: redis-py follows it (and refreshes its map) below
                assembler = Assembler(frame_table, self.max_state_bytes, chunking)
        # Frames are accepted on the hashing threads while the next one is on the wire. One frame per
        # request by default: a multi-frame reply makes the server buffer, and the parser grow, tens of
        # megabytes at once.
        for i in range(0, len(keys), self.frames_per_mget):
            if not assembler.add(self._call("MGET frames", fetch, keys[i : i + self.frames_per_mget])):
                return None
        return StoredState(manifest, assembler.result(), accepted)

    def _read_direct(self, keys: list[str], assembler: Assembler, manifest: bytes, accepted: Any) -> StoredState | None:
        """Each frame received straight into its slot and accepted there while the next one is on
        the wire, over `connections` connections of our own to the node that holds the state."""
        assert self.frame_pool is not None
        pool = self.frame_pool
        if self.breaker.is_open:
            raise self._skipped("GET frames")
        host, port = self._node_of(keys[0])
        lanes = min(self.connections, len(keys))

        def lane(start: int) -> bool:
            connection = pool.take(host, port)
            healthy = False
            try:
                for index in range(start, len(keys), lanes):
                    connection, found = pool.retried(host, port, connection,
                                                     lambda c: c.get_into(keys[index], assembler.slot(index)))
                    if not found:
                        healthy = True
                        return False
                    assembler.received(index)
                healthy = True
                return True
            except RedirectError:
                raise
            except StoreError as e:
                self.breaker.trip(f"{e} at {time.strftime('%H:%M:%S')}")
                raise StoreUnavailableError(str(e), tier=self.url) from e
            finally:
                (pool.give(host, port, connection) if healthy else connection.close())

        results = [lane(0)] if lanes == 1 else list(_lanes().map(lane, range(lanes)))
        if not all(results):
            return None
        assembler.placed(len(keys))
        return StoredState(manifest, assembler.result(), accepted)

    def _node_of(self, name: str) -> tuple[str, int]:
        """The server that holds `name`: the URL's, or the cluster node that serves its slot."""
        if not self.cluster:
            assert self._node is not None
            return self._node
        node = self._call("CLUSTER SLOTS", self.client.get_node_from_key, name)
        return node.host, int(node.port)

    def _holds(self, key: str) -> bool:
        frame_table = self.get_frame_table(key)
        if frame_table is None:
            return False
        if frame_table.payload_bytes > self.max_state_bytes:
            return False
        keys = self._fkeys(key, frame_table)  # one slot (the {key} hash tag): one EXISTS, one round trip
        return not keys or self._call("EXISTS", lambda: self.client.exists(*keys)) == len(keys)

    def delete(self, key: str) -> None:
        frame_table = self.get_frame_table(key)

        def remove() -> None:
            self.client.delete(self._mkey(key))  # the frame table first: readers see a miss, never a half
            for name in self._fkeys(key, frame_table) if frame_table else []:
                self.client.delete(name)

        self._call("DEL", remove)

    def _scan(self, pattern: str) -> Iterator[str]:
        if self.breaker.is_open:
            raise self._skipped("SCAN")
        try:
            for name in self.client.scan_iter(match=pattern, count=1000):
                yield name.decode() if isinstance(name, bytes) else name
        except _redis_errors() as e:
            raise self._failure("SCAN", e) from e

    def keys(self) -> Iterator[str]:
        for name in self._scan(f"{self.prefix}:{{*}}:m"):
            match = _STATE_FROM_KEY.search(name)
            if match:
                yield match.group(1)

    def orphan_frames(self, grace_s: float = 0.0) -> list[str]:
        """Frame keys that no frame table refers to (left by an interrupted or superseded write) and
        that nothing touched for `grace_s` seconds (a write in progress writes its frame table last)."""
        wanted: dict[str, set[str]] = {}
        orphans = []
        for name in self._scan(f"{self.prefix}:{{*}}:f:*"):
            match = _STATE_FROM_KEY.search(name)
            if not match:
                continue
            key = match.group(1)
            if key not in wanted:
                try:
                    frame_table = self.get_frame_table(key)
                except Exception:  # noqa: BLE001 - an unreadable frame table refers to nothing
                    frame_table = None
                wanted[key] = set(self._fkeys(key, frame_table)) if frame_table else set()
            if name not in wanted[key] and self._idle(name) >= grace_s:
                orphans.append(name)
        return orphans

    def _idle(self, name: str) -> float:
        """Seconds since `name` was last touched (0 when Redis cannot tell, e.g. under an LFU policy)."""
        try:
            return float(self.client.object("idletime", name) or 0)
        except _redis_errors():
            return 0.0

    def delete_raw(self, names: list[str]) -> int:
        return sum(self._call("DEL", lambda n=name: self.client.delete(n)) for name in names)

    def _bkey(self, name: str) -> str:
        return f"{self.prefix}:blob:{check_blob_name(name)}"

    def get_blob(self, name: str) -> bytes | None:
        return self._call("GET", lambda: self.client.get(self._bkey(name)))

    def put_blob(self, name: str, data: bytes, *, ttl: int | None = None) -> None:
        self._call("SET", lambda: self.client.set(self._bkey(name), data, ex=ttl or self.ttl))

    def delete_blob(self, name: str) -> None:
        self._call("DEL", lambda: self.client.delete(self._bkey(name)))

    def blob_names(self, namespace: str) -> Iterator[str]:
        start = len(f"{self.prefix}:blob:")
        return (name[start:] for name in self._scan(f"{self.prefix}:blob:{namespace}/*"))

    def close(self) -> None:
        if self.frame_pool is not None:
            self.frame_pool.close()
        if self._client is not None:
            try:
                self._client.close()
            except _redis_errors():
                pass
            self._client = None
