"""Redis and Redis Cluster tiers: a frame record plus payload frames, pipelined, hash-tagged.

Keys for a state `K` are `PREFIX:{K}:m` (the frame record) and `PREFIX:{K}:f:<payload id>:<i>`
(its frames). The `{K}` hash tag puts them all in one cluster slot, so one MGET fetches a whole
state on a single node. Every Redis failure surfaces as `StoreError`, which the engine treats as a
miss in this tier: the next tier or a text re-prefill answers instead.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Iterator
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvrag.errors import StoreError
from kvrag.stores.base import BlobStore, StateStore, StoredState, check_blob_name, check_key
from kvrag.stores.frames import DEFAULT_FRAME_BYTES, Assembler, FrameRecord, make_record, parse_record

__all__ = ["RedisStore", "redis_store_from_url"]

_OUR_PARAMS = ("ttl", "frame_mib", "prefix")
_STATE_FROM_KEY = re.compile(r"\{([0-9a-f]{64})\}")


def _redis_errors() -> tuple[type[BaseException], ...]:
    import redis

    return (redis.exceptions.RedisError, OSError)


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
    ) -> None:
        self.url = url
        self.cluster = cluster
        self.max_state_bytes = max_state_bytes
        self.prefix = prefix
        self.frame_bytes = frame_bytes
        self.ttl = ttl
        self.frames_per_mget = frames_per_mget
        self._client_factory = client_factory
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            try:
                self._client = self._client_factory()
            except _redis_errors() as e:
                raise StoreError(f"cannot connect to {self.url}: {e}") from e
        return self._client

    def _mkey(self, key: str) -> str:
        return f"{self.prefix}:{{{check_key(key)}}}:m"

    def _fkeys(self, key: str, record: FrameRecord) -> list[str]:
        return [f"{self.prefix}:{{{key}}}:f:{record.payload_id}:{i}" for i in range(len(record.frames))]

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _redis_errors() as e:
            raise StoreError(f"{what} failed on {self.url}: {type(e).__name__}: {e}") from e

    def get_record(self, key: str) -> FrameRecord | None:
        raw = self._call("GET", lambda: self.client.get(self._mkey(key)))
        return None if raw is None else parse_record(raw)

    def read_manifest(self, key: str) -> bytes | None:
        record = self.get_record(key)
        return None if record is None else record.manifest.encode()

    def read(self, key: str, check: Callable[[bytes], Any] | None = None) -> StoredState | None:
        """The record, then its frames: the manifest and payload of one write, always together
        (a rewrite of the key in between leaves the old frames until gc)."""
        record = self.get_record(key)
        if record is None:
            return None
        manifest = record.manifest.encode()
        checked = check(manifest) if check else None
        keys = self._fkeys(key, record)
        assembler = Assembler(record, self.max_state_bytes)

        def fetch(batch: list[str]) -> list[Any]:
            if self.cluster:  # a cluster pipeline refuses MGET; its GETs all go to the slot's node
                pipe = self.client.pipeline(transaction=False)
                for name in batch:
                    pipe.get(name)
                return list(pipe.execute())
            return list(self.client.mget(batch))

        # Frames are checked on the hashing threads while the next one is on the wire. One frame per
        # request measured fastest here: a multi-frame reply makes the server buffer, and the parser
        # grow, tens of megabytes at once.
        for i in range(0, len(keys), self.frames_per_mget):
            if not assembler.add(self._call("MGET frames", fetch, keys[i : i + self.frames_per_mget])):
                return None
        return StoredState(manifest, assembler.result(), checked)

    def put(self, key: str, manifest: bytes, payload: Any) -> None:
        record, frames = make_record(manifest, payload, self.frame_bytes)
        keys = self._fkeys(key, record)

        def write() -> None:
            pipe = self.client.pipeline(transaction=False)
            for name, frame in zip(keys, frames):
                pipe.set(name, frame.tobytes() if len(frames) > 1 else bytes(frame), ex=self.ttl)
            pipe.execute()
            # The record last: a reader never finds a record whose frames are not all written.
            self.client.set(self._mkey(key), record.model_dump_json(), ex=self.ttl)

        self._call("SET", write)

    def delete(self, key: str) -> None:
        record = self.get_record(key)

        def remove() -> None:
            self.client.delete(self._mkey(key))  # the record first: readers see a miss, never a half
            for name in self._fkeys(key, record) if record else []:
                self.client.delete(name)

        self._call("DEL", remove)

    def _scan(self, pattern: str) -> Iterator[str]:
        try:
            for name in self.client.scan_iter(match=pattern, count=1000):
                yield name.decode() if isinstance(name, bytes) else name
        except _redis_errors() as e:
            raise StoreError(f"SCAN failed on {self.url}: {e}") from e

    def keys(self) -> Iterator[str]:
        for name in self._scan(f"{self.prefix}:{{*}}:m"):
            match = _STATE_FROM_KEY.search(name)
            if match:
                yield match.group(1)

    def orphan_frames(self) -> list[str]:
        """Frame keys that no record refers to (left by an interrupted or superseded write)."""
        wanted: dict[str, set[str]] = {}
        orphans = []
        for name in self._scan(f"{self.prefix}:{{*}}:f:*"):
            match = _STATE_FROM_KEY.search(name)
            if not match:
                continue
            key = match.group(1)
            if key not in wanted:
                try:
                    record = self.get_record(key)
                except Exception:  # noqa: BLE001 - an unreadable record refers to nothing
                    record = None
                wanted[key] = set(self._fkeys(key, record)) if record else set()
            if name not in wanted[key]:
                orphans.append(name)
        return orphans

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
        if self._client is not None:
            try:
                self._client.close()
            except _redis_errors():
                pass
            self._client = None


def _split_our_params(url: str) -> tuple[str, dict[str, str]]:
    parts = urlsplit(url)
    ours, theirs = {}, []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        (ours.__setitem__(name, value) if name in _OUR_PARAMS else theirs.append((name, value)))
    return urlunsplit(parts._replace(query=urlencode(theirs))), ours


def _connection_kwargs(url: str) -> dict[str, Any]:
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    parts = urlsplit(url)
    kwargs: dict[str, Any] = {
        "socket_connect_timeout": float(os.environ.get("KVRAG_REDIS_CONNECT_TIMEOUT", "2")),
        "socket_timeout": float(os.environ.get("KVRAG_REDIS_TIMEOUT", "30")),
        "retry": Retry(ExponentialBackoff(cap=0.1, base=0.01), 1),
    }
    if not parts.username and os.environ.get("KVRAG_REDIS_USERNAME"):
        kwargs["username"] = os.environ["KVRAG_REDIS_USERNAME"]
    if not parts.password and os.environ.get("KVRAG_REDIS_PASSWORD"):
        kwargs["password"] = os.environ["KVRAG_REDIS_PASSWORD"]
    if parts.scheme == "rediss":
        for env, arg in (("KVRAG_REDIS_CA_CERT", "ssl_ca_certs"), ("KVRAG_REDIS_CERT", "ssl_certfile"), ("KVRAG_REDIS_KEY", "ssl_keyfile")):
            if os.environ.get(env):
                kwargs[arg] = os.environ[env]
    return kwargs


def redis_store_from_url(url: str) -> RedisStore:
    """`redis://[user:pass@]host:port/db`, `rediss://...` (TLS), or `redis+cluster://h:p[,h:p...]`.

    Query parameters: `ttl` (seconds), `frame_mib` (frame size), `prefix` (key prefix); others go
    to redis-py. Credentials and TLS files may also come from `KVRAG_REDIS_USERNAME`,
    `KVRAG_REDIS_PASSWORD`, `KVRAG_REDIS_CA_CERT`, `KVRAG_REDIS_CERT`, `KVRAG_REDIS_KEY`.
    """
    redis_url, ours = _split_our_params(url)
    try:
        ttl = int(ours["ttl"]) if ours.get("ttl") else None
        frame_bytes = int(float(ours.get("frame_mib", DEFAULT_FRAME_BYTES / 2**20)) * 2**20)
    except ValueError as e:
        raise StoreError(f"bad ttl or frame_mib in {url!r}: {e}") from e
    if frame_bytes < 1 or (ttl is not None and ttl < 1):
        raise StoreError(f"ttl and frame_mib must be positive in {url!r}")
    prefix = ours.get("prefix", "kvrag")
    scheme = urlsplit(redis_url).scheme
    try:
        import redis
    except ImportError as e:  # pragma: no cover - redis is a dependency
        raise StoreError("Redis stores need the redis package: pip install 'redis[hiredis]'") from e
    if scheme in ("redis", "rediss"):
        kwargs = _connection_kwargs(redis_url)

        def factory() -> Any:
            return redis.Redis.from_url(redis_url, **kwargs)

    elif scheme == "redis+cluster":
        parts = urlsplit(redis_url)
        hosts = parts.netloc.rsplit("@", 1)[-1]
        try:
            nodes = [redis.cluster.ClusterNode(h.rsplit(":", 1)[0], int(h.rsplit(":", 1)[1])) for h in hosts.split(",") if h]
        except (ValueError, IndexError) as e:
            raise StoreError(f"redis+cluster:// needs host:port[,host:port...], got {hosts!r}") from e
        if not nodes:
            raise StoreError(f"redis+cluster:// needs at least one host:port, got {url!r}")
        kwargs = _connection_kwargs(redis_url)
        kwargs.pop("retry")
        if parts.username:
            kwargs["username"] = parts.username
        if parts.password:
            kwargs["password"] = parts.password

        def factory() -> Any:
            return redis.RedisCluster(startup_nodes=nodes, **kwargs)

    else:
        raise StoreError(f"not a Redis URL: {url!r}")
    return RedisStore(factory, url=url, prefix=prefix, frame_bytes=frame_bytes, ttl=ttl, cluster=scheme == "redis+cluster")
