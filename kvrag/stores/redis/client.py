"""Redis and Redis Cluster tiers: a frame table plus payload frames, pipelined, hash-tagged.

Keys for a state `K` are `PREFIX:{K}:m` (the frame table) and `PREFIX:{K}:f:<payload id>:<i>`
(its frames). The `{K}` hash tag puts them all in one cluster slot, so one MGET fetches a whole
state on a single node. Every Redis failure surfaces as `StoreError`, which the engine treats as a
miss in this tier: the next tier or a text re-prefill answers instead.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Any, Callable, Iterator, Sequence

from kvrag.artifacts.digests import ChunkOpener, hash_pool, spans, stored_form
from kvrag.artifacts.format import parse_manifest
from kvrag.errors import (
    IntegrityError,
    RedirectError,
    StateError,
    StateNotFoundError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from kvrag.stores.base import (
    UNTRUSTED_PARSE_ERRORS,
    BlobStore,
    ManifestAcceptance,
    Receive,
    StateStore,
    StoredState,
    check_blob_name,
    check_key,
)
from kvrag.stores.deadline import Breaker, Deadline
from kvrag.stores.outages import answered, public_url
from kvrag.stores.redis.frames import DEFAULT_FRAME_BYTES, Assembler, FrameTable, make_frame_table, parse_frame_table
from kvrag.stores.redis.wire import FramePool

__all__ = ["RedisStore"]

#: frame requests a run's connection keeps ahead of the frame being received
_AHEAD = 2

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


class RedisStore(StateStore, BlobStore):
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
            if (frame_table.payload_bytes, frame_table.frame_bytes, list(frame_table.frames)) != (
                vouched.size, vouched.chunk_bytes, list(vouched.chunks)
            ):
                raise IntegrityError(f"state {key[:12]}: its frame table does not list the manifest's chunks")
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
                    try:
                        found = connection.get_into(keys[index], assembler.slot(index))
                    except RedirectError:
                        raise
                    except StoreError:
                        if not connection.reused:
                            raise
                        # a pooled connection the server closed since (a restart): one fresh one, once
                        connection.close()
                        connection = pool.connect(host, port)
                        found = connection.get_into(keys[index], assembler.slot(index))
                    connection.reused = False
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

    def receive_run(self, reads: Sequence[Receive], deadline: Deadline | None = None) -> tuple[int, Exception | None]:
        """Read a run of states, each through its acceptance's manifest check, their payloads
        received straight into the caller's memory (`Receive.pieces`) and each chunk checked where
        it lies: how many landed, from the first, and why the next did not (None: all did). The
        error is a `StateError` (absent, damaged, foreign, unsigned, the server down or past
        `deadline`), or a `StoreError` for a state that cannot be received in place (sealed, or its
        slot moved): read that one with `fetch`. What the pieces of a state that did not land hold
        is undefined.

        Every frame table comes in one round trip, then every frame, in order, over one connection
        of our own, two requests ahead (the server never idles, nor buffers more than two frames),
        each checked on the hashing threads while the next arrives. It runs in the caller's thread
        and every socket wait is bounded by `deadline`: nothing writes into (or reads) the pieces
        once it returns."""
        if self.frame_pool is None:
            return 0, StoreError(f"{public_url(self.url)} reads through redis-py (wire=client): use fetch")
        if not reads:
            return 0, None
        what = f"reading {len(reads)} states from {self.url}"
        try:
            # frame tables write nothing into the pieces: a read of them past the deadline is left behind
            tables = self.guarded(lambda: self._call("GET frame tables", self._frame_tables, [r.key for r in reads]),
                                  deadline, what)
        except StateError as e:
            return 0, e.located(reads[0].key, self.url)
        planned: list[tuple[Receive, FrameTable, ChunkOpener]] = []
        stop: Exception | None = None
        for read, raw in zip(reads, tables):
            try:
                planned.append((read, *self._accepted(read, raw)))
            except StateError as e:
                stop = e.located(read.key, self.url)
                break
            except StoreError as e:
                stop = e
                break
            except UNTRUSTED_PARSE_ERRORS as e:
                stop = IntegrityError(f"state {read.key[:12]} in {self.url} does not parse: {type(e).__name__}: "
                                      f"{str(e)[:200]}", key=read.key, tier=self.url)
                break
        landed, error = 0, None
        for group in self._by_node(planned):
            done, error = self._receive(group, deadline, what)
            landed += done
            if error is not None:
                break
        return landed, error if error is not None else stop

    def _by_node(self, planned: list[tuple[Receive, FrameTable, ChunkOpener]]) -> list[list[tuple[Receive, FrameTable, ChunkOpener]]]:
        """The planned states in runs that one server holds (a cluster spreads them over its nodes)."""
        groups: list[list[tuple[Receive, FrameTable, ChunkOpener]]] = []
        last = None
        for item in planned:
            node = self._node_of(self._mkey(item[0].key)) if self.cluster else self._node
            if not groups or node != last:
                groups.append([])
            groups[-1].append(item)
            last = node
        return groups

    def _frame_tables(self, keys: list[str]) -> list[bytes | None]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(self._mkey(key))
        return list(pipe.execute())

    def _accepted(self, read: Receive, raw: bytes | None) -> tuple[FrameTable, ChunkOpener]:
        """The frame table and chunk check of one state to receive, its manifest accepted."""
        if raw is None:
            raise StateNotFoundError(f"no state {read.key[:12]} in {self.url}")
        frame_table = parse_frame_table(raw)
        chunking = read.acceptance.manifest(frame_table.manifest.encode(), self).chunking
        if chunking is None:
            raise IntegrityError(f"state {read.key[:12]}: its manifest names no payload checks")
        if (frame_table.payload_bytes, frame_table.frame_bytes, list(frame_table.frames)) != (
            chunking.size, chunking.chunk_bytes, list(chunking.chunks)
        ):
            raise IntegrityError(f"state {read.key[:12]}: its frame table does not list the manifest's chunks")
        size = sum(len(piece) for piece in read.pieces)
        if size != chunking.size:
            raise IntegrityError(f"state {read.key[:12]} is {chunking.size} bytes, not the {size} bytes it is read into")
        if not chunking.chunk_opener.in_place:
            raise StoreError(f"state {read.key[:12]} is sealed: its chunks open into a buffer of their own (use fetch)")
        return frame_table, chunking.chunk_opener

    def _receive(self, planned: list[tuple[Receive, FrameTable, ChunkOpener]], deadline: Deadline | None,
                 what: str) -> tuple[int, Exception | None]:
        """The frames of the planned states, received in order (see `receive_run`)."""
        assert self.frame_pool is not None
        frames = [(state, index, name, spans(read.pieces, index * table.frame_bytes,
                                             index * table.frame_bytes + table.frame_length(index)))
                  for state, (read, table, _) in enumerate(planned)
                  for index, name in enumerate(self._fkeys(read.key, table))]
        if not frames:
            return len(planned), None
        pool, timeout = self.frame_pool, self.frame_pool.options.get("timeout", 5.0)
        host, port = self._node_of(frames[0][2])
        connection = pool.take(host, port)
        checks: list[tuple[int, Future[bool]]] = []
        arrived, error, healthy = 0, None, False  # arrived: states whose every frame arrived
        try:
            asked = min(_AHEAD, len(frames))
            try:
                connection.ask(*(name for _, _, name, _ in frames[:asked]))
            except StoreError:
                if not connection.reused:
                    raise
                connection.close()  # a pooled connection the server closed since (a restart): one fresh one, once
                connection = pool.connect(host, port)
                connection.ask(*(name for _, _, name, _ in frames[:asked]))
            for at, (state, index, _, pieces) in enumerate(frames):
                if asked < len(frames):
                    connection.ask(frames[asked][2])
                    asked += 1
                if deadline is not None:
                    if deadline.expired:
                        raise StoreTimeoutError(f"{what}: no answer within the request's {deadline.seconds:g} s deadline")
                    connection.sock.settimeout(min(timeout, max(deadline.remaining(), 1e-3)))
                if not connection.reply_into(pieces):  # evicted since its frame table was read: a miss
                    error = StateNotFoundError(f"a frame of state {planned[state][0].key[:12]} is gone from {self.url}")
                    break
                checks.append((state, hash_pool().submit(planned[state][2].check, index, pieces)))
                if at + 1 == len(frames) or frames[at + 1][0] != state:
                    arrived = state + 1
            healthy = error is None
        except (StoreTimeoutError, IntegrityError, RedirectError) as e:
            error = e
        except StoreError as e:
            if deadline is not None and deadline.expired:
                error = StoreTimeoutError(f"{what}: no answer within the request's {deadline.seconds:g} s deadline")
            else:
                self.breaker.trip(f"{e} at {time.strftime('%H:%M:%S')}")
                error = StoreUnavailableError(str(e), tier=self.url)
        finally:
            # every check waited for before this returns: none reads the pieces afterwards
            failed = [state for state, check in checks if not check.result()]
            if healthy:
                connection.sock.settimeout(timeout)
                pool.give(host, port, connection)
            else:  # replies may still be on their way: the connection's place in the stream is unknown
                connection.close()
        landed = min([arrived, *failed])
        if failed and failed[0] == landed:
            key = planned[landed][0].key
            error = IntegrityError(f"state {key[:12]}: a frame does not pass its {planned[landed][2].name} check")
        if error is None:
            answered(self.url)
        elif landed < len(planned) and isinstance(error, StateError):
            error.located(planned[landed][0].key, self.url)
        return landed, error

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

    def holds_run(self, keys: Sequence[str], deadline: Deadline | None = None) -> int:
        """`holds` for a run of states in two round trips: every frame table, then every frame's
        presence (pipelined; a cluster's pipeline sends each node its share)."""
        def run() -> int:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.get(self._mkey(key))
            tables = pipe.execute()
            frames: list[list[str]] = []
            for key, raw in zip(keys, tables):
                try:
                    table = None if raw is None else parse_frame_table(raw)
                except IntegrityError:  # a frame table that does not parse holds nothing
                    break
                if table is None or table.payload_bytes > self.max_state_bytes:
                    break
                frames.append(self._fkeys(key, table))
            pipe = self.client.pipeline(transaction=False)
            for names in frames:
                if names:
                    pipe.exists(*names)
            present = iter(pipe.execute())
            for count, names in enumerate(frames):
                if names and next(present) != len(names):
                    return count
            return len(frames)

        if not keys:
            return 0
        try:
            return self.guarded(lambda: self._call("GET frame tables", run), deadline,
                                f"checking {len(keys)} states in {self.url}")
        except (StoreError, StateError, *UNTRUSTED_PARSE_ERRORS):
            return 0

    def put(self, key: str, manifest: bytes, payload: Any) -> None:
        # One frame per chunk of the manifest, so a reader checks frames against the signed chunk digests.
        payload = stored_form(payload)  # a sealed state promoted here: its stored bytes, never its plaintext
        frame_table, frames = make_frame_table(manifest, payload, _chunk_bytes(manifest, self.frame_bytes))
        keys = self._fkeys(key, frame_table)

        def write() -> None:
            pipe = self.client.pipeline(transaction=False)
            for name, frame in zip(keys, frames):
                pipe.set(name, frame.tobytes() if len(frames) > 1 else bytes(frame), ex=self.ttl)
            pipe.execute()
            # The frame table last: a reader never finds a frame table whose frames are not all written.
            self.client.set(self._mkey(key), frame_table.model_dump_json(), ex=self.ttl)

        self._call("SET", write)

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


def _chunk_bytes(manifest: bytes, default: int) -> int:
    """The chunk size a manifest declares (frames are its chunks); `default` if it declares none."""
    try:
        value = json.loads(manifest).get("payload_chunk_bytes", default)
        return value if isinstance(value, int) and 1 <= value <= 1 << 30 else default
    except (ValueError, AttributeError, RecursionError):
        return default
