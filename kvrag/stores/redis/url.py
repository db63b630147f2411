"""Redis store URLs: `redis://`, `rediss://` (TLS) and `redis+cluster://`, their parameters,
credentials from the environment, short timeouts, and the direct frame readers' settings."""

from __future__ import annotations

import math
import os
import re
import socket
import ssl
from typing import Any, Callable
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from kvrag.errors import StoreError, cause_of
from kvrag.stores.base import shorten
from kvrag.stores.outages import public_url
from kvrag.stores.redis.client import RedisStore
from kvrag.stores.redis.frames import DEFAULT_FRAME_BYTES
from kvrag.stores.redis.wire import FramePool

__all__ = ["redis_store_from_url"]

#: kvrag's own query parameters of a Redis URL (the rest go to redis-py)
PARAMS = ("ttl", "frame_mib", "prefix", "connections", "wire")


def _split_our_params(url: str) -> tuple[str, dict[str, str]]:
    parts = urlsplit(url)
    ours, theirs = {}, []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        (ours.__setitem__(name, value) if name in PARAMS else theirs.append((name, value)))
    return urlunsplit(parts._replace(query=urlencode(theirs))), ours


def _connection_kwargs(url: str) -> dict[str, Any]:
    """Short timeouts; no retry on a timeout, one reconnect on a connection error (a pooled
    connection a restarted server closed): a slow or wrong server costs seconds, then the text answers."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    parts = urlsplit(url)
    kwargs: dict[str, Any] = {
        "socket_connect_timeout": _seconds("KVRAG_REDIS_CONNECT_TIMEOUT", 1.0),
        "socket_timeout": _seconds("KVRAG_REDIS_TIMEOUT", 5.0),
        "retry": Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
        "retry_on_timeout": False,
    }
    if not parts.username and os.environ.get("KVRAG_REDIS_USERNAME"):
        kwargs["username"] = os.environ["KVRAG_REDIS_USERNAME"]
    if not parts.password and os.environ.get("KVRAG_REDIS_PASSWORD"):
        kwargs["password"] = os.environ["KVRAG_REDIS_PASSWORD"]
    if parts.scheme in ("rediss", "rediss+cluster"):
        for env, arg in (("KVRAG_REDIS_CA_CERT", "ssl_ca_certs"), ("KVRAG_REDIS_CERT", "ssl_certfile"), ("KVRAG_REDIS_KEY", "ssl_keyfile")):
            if os.environ.get(env):
                kwargs[arg] = os.environ[env]
    return kwargs


def _seconds(env: str, default: float) -> float:
    try:
        value = float(os.environ.get(env, default))
    except ValueError as e:
        raise StoreError(f"{env} must be a number of seconds: {e}") from e
    if not 0 < value < 3600:
        raise StoreError(f"{env} must be between 0 and 3600 seconds")
    return value


def _hosts(netloc: str) -> list[tuple[str, int]]:
    """`host:port[,host:port...]` (after any credentials), ports checked."""
    hosts = []
    for item in netloc.rsplit("@", 1)[-1].split(","):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
            raise StoreError(f"{shorten(item)} is not host:port with a port from 1 to 65535")
        hosts.append((host, int(port)))
    return hosts


def redis_store_from_url(url: str) -> RedisStore:
    """`redis://[user:pass@]host:port/db`, `rediss://...` (TLS), or `redis+cluster://h:p[,h:p...]`.

    Query parameters: `ttl` (seconds), `frame_mib` (frame size), `prefix` (key prefix), `connections`
    (connections a state's frames are received over by the direct wire, default 2), `wire` (`direct`, the default for
    plain TCP: frames received straight into the payload buffer; `client`: through redis-py);
    others go to redis-py. Credentials and TLS files may also come from `KVRAG_REDIS_USERNAME`,
    `KVRAG_REDIS_PASSWORD`, `KVRAG_REDIS_CA_CERT`, `KVRAG_REDIS_CERT`, `KVRAG_REDIS_KEY`.
    """
    redis_url, ours = _split_our_params(url)
    ttl, frame_bytes, connections, wire, prefix = _our_settings(ours)
    scheme = urlsplit(redis_url).scheme
    if scheme == "redis+cluster" and _cluster_tls(redis_url):
        scheme = "rediss+cluster"
    if scheme in ("redis", "rediss"):
        _hosts(urlsplit(redis_url).netloc)  # a port that is not a number fails here, with one line
    try:
        import redis
    except ImportError as e:  # pragma: no cover - redis is a dependency
        raise StoreError("Redis stores need the redis package: pip install 'redis[hiredis]'") from e
    if scheme in ("redis", "rediss"):
        factory, kwargs, frame_pool, node = _server(redis_url, scheme, wire)
    elif scheme in ("redis+cluster", "rediss+cluster"):
        (factory, kwargs, frame_pool), node = _cluster(url, redis_url, scheme, wire), None
    else:
        raise StoreError(f"not a Redis URL: {url!r}")
    if "cluster" in scheme:
        nodes = _hosts(urlsplit(redis_url).netloc)[:3]
        clients = [lambda host=host, port=port: redis.Redis(host=host, port=port, **_short(kwargs)) for host, port in nodes]
    else:
        parsed = redis.connection.parse_url(redis_url)
        nodes = [(parsed.get("host", "localhost"), int(parsed.get("port", 6379)))]
        clients = [lambda: redis.Redis.from_url(redis_url, **_short(kwargs))]
    if scheme.startswith("rediss"):
        _check_tls(url, nodes, clients)
    probe = _probe(clients, cluster="cluster" in scheme)
    return RedisStore(factory, url=url, prefix=prefix, frame_bytes=frame_bytes, ttl=ttl, cluster="cluster" in scheme,
                      connections=connections, frame_pool=frame_pool, node=node, probe=probe)


def _our_settings(ours: dict[str, str]) -> tuple[int | None, int, int, str, str]:
    """kvrag's own query parameters, checked: ttl, frame bytes, connections, wire and key prefix."""
    try:
        ttl = int(ours["ttl"]) if ours.get("ttl") else None
        frame_mib = float(ours.get("frame_mib", DEFAULT_FRAME_BYTES / 2**20))
        connections = int(ours.get("connections", 2))
        wire = ours.get("wire", "direct")
    except ValueError as e:
        raise StoreError(f"ttl and connections must be whole numbers and frame_mib a number of MiB: {e}") from e
    if wire not in ("direct", "client"):
        raise StoreError("wire must be direct (frames received straight into the payload buffer) or client (redis-py)")
    if not 1 <= connections <= 8:
        raise StoreError("connections (a state's frames are fetched over) must be from 1 to 8")
    if not math.isfinite(frame_mib) or not 4096 <= frame_mib * 2**20 <= 1 << 30:
        raise StoreError(f"frame_mib must be from 0.004 (4 KiB) to 1024 (1 GiB), got {shorten(ours['frame_mib'])}")
    if ttl is not None and ttl < 1:
        raise StoreError("ttl must be at least 1 second")
    prefix = ours.get("prefix", "kvrag")
    if not prefix or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", prefix):
        raise StoreError(f"prefix {shorten(prefix)} may hold only letters, digits and _ . : - "
                         "(glob characters would let one prefix's gc reach another's keys)")
    return ttl, int(frame_mib * 2**20), connections, wire, prefix


def _server(redis_url: str, scheme: str, wire: str) -> tuple[Callable[[], Any], dict[str, Any], Any, Any]:
    """One server's client factory, its connection options, and (plain TCP, direct wire) the frame
    pool and the node it reads from."""
    import redis

    kwargs = _connection_kwargs(redis_url)
    frame_pool, node = None, None
    if scheme == "redis" and wire == "direct":
        parsed = redis.connection.parse_url(redis_url)
        node = (parsed.get("host", "localhost"), int(parsed.get("port", 6379)))
        frame_pool = _frame_pool(kwargs, parsed.get("db", 0), parsed.get("username"), parsed.get("password"))
    return (lambda: redis.Redis.from_url(redis_url, **kwargs)), kwargs, frame_pool, node


def _cluster(url: str, redis_url: str, scheme: str, wire: str) -> tuple[Callable[[], Any], dict[str, Any], Any]:
    """A cluster's client factory, its connection options, and (plain TCP, direct wire) the frame pool."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    parts = urlsplit(redis_url)
    nodes = [redis.cluster.ClusterNode(host, port) for host, port in _hosts(parts.netloc)]
    if not nodes:
        raise StoreError(f"redis+cluster:// needs at least one host:port, got {url!r}")
    kwargs = {**_connection_kwargs(redis_url.replace(parts.scheme, scheme, 1)), **_cluster_options(parts.query)}
    kwargs["retry"] = Retry(NoBackoff(), 0)  # the cluster client's own retries (backoff, attempts): none
    if parts.username:
        kwargs["username"] = unquote(parts.username)
    if parts.password:
        kwargs["password"] = unquote(parts.password)
    frame_pool = None
    if scheme == "rediss+cluster":
        kwargs["ssl"] = True  # TLS or nothing: a node that does not speak it is unreachable, never plaintext
    elif wire == "direct":
        frame_pool = _frame_pool(kwargs, 0, kwargs.get("username"), kwargs.get("password"))
    options = {k: v for k, v in kwargs.items() if k != "retry_on_timeout"}
    return (lambda: redis.RedisCluster(startup_nodes=nodes, **options)), kwargs, frame_pool


#: a cluster URL's query parameters that kvrag passes to redis-py (anything else is refused)
#: a cluster URL's TLS parameters, besides `ssl`
CLUSTER_TLS_PARAMS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")


def _cluster_tls(url: str) -> bool:
    value = dict(parse_qsl(urlsplit(url).query)).get("ssl", "")
    if value.lower() not in ("", "true", "false", "1", "0", "yes", "no"):
        raise StoreError(f"ssl must be true or false, got {shorten(value)}")
    return value.lower() in ("true", "1", "yes")


def _cluster_options(query: str) -> dict[str, Any]:
    """A cluster URL's query, parsed as redis-py parses a single node's: TLS files and checks,
    timeouts; an unknown parameter is refused, never silently dropped."""
    options: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == "ssl":
            continue
        if name in ("socket_timeout", "socket_connect_timeout"):
            try:
                options[name] = float(value)
            except ValueError as e:
                raise StoreError(f"{name} must be a number of seconds, got {shorten(value)}") from e
            if not 0 < options[name] < 3600:
                raise StoreError(f"{name} must be between 0 and 3600 seconds")
        elif name in CLUSTER_TLS_PARAMS:
            options[name] = value.lower() in ("true", "1", "yes") if name == "ssl_check_hostname" else value
        else:
            raise StoreError(f"redis+cluster:// does not take {shorten(name)}; it takes ssl, {', '.join(CLUSTER_TLS_PARAMS)}, "
                             "socket_timeout, socket_connect_timeout and kvrag's own (ttl, frame_mib, prefix, connections, wire)")
    return options


def _short(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` (credentials, TLS) with 1 s timeouts and no retry: for the breaker's probe, which
    runs on a thread of its own (a caller waits for it a tenth of a second at most)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kept = {k: v for k, v in kwargs.items() if k.startswith("ssl") or k in ("username", "password")}
    return {**kept, "socket_timeout": 1.0, "socket_connect_timeout": 1.0, "retry": Retry(NoBackoff(), 0)}


def _probe(clients: list[Callable[[], Any]], *, cluster: bool = False) -> Callable[[], bool]:
    """A liveness check for the breaker: a PING on a connection of its own (for a cluster, CLUSTER
    INFO saying its state is ok: a node up but not yet serving its slots is not back), to the first
    node that answers; when none does, what the last one said is raised (the breaker keeps it)."""
    import redis

    def probe() -> bool:
        failure: Exception | None = None
        for make in clients:
            client = make()
            try:
                if _cluster_ok(client) if cluster else client.ping():
                    return True
            except redis.exceptions.RedisError as e:
                failure = e
                continue
            finally:
                client.close()
        if failure is not None:
            raise StoreError(f"no node answered a PING: {type(failure).__name__}: {failure}") from failure
        return False

    return probe


def _check_tls(url: str, nodes: list[tuple[str, int]], clients: list[Callable[[], Any]]) -> None:
    """Refuse at once a TLS URL whose server does not complete a TLS handshake with these settings
    (a plaintext server, a certificate not trusted): a configuration error, never an outage. A node
    that cannot be reached at all says nothing: the store starts as down and is used once it is up."""
    for (host, port), make in zip(nodes, clients):
        client = make()
        try:
            client.ping()
            return
        except Exception as e:  # noqa: BLE001 - only a TLS failure is ours to raise; the rest is "down" or later
            tls = cause_of(e, ssl.SSLError)
            if isinstance(tls, ssl.SSLCertVerificationError):
                raise StoreError(f"{public_url(url)}: the certificate of {host}:{port} is not trusted ({tls.verify_message}): "
                                 "give the CA that signed it with ssl_ca_certs=PATH in the URL or KVRAG_REDIS_CA_CERT "
                                 "(ssl_check_hostname=false if it names another host)") from e
            if tls is not None or _speaks_plaintext(host, port):
                raise StoreError(f"{public_url(url)}: {host}:{port} does not complete a TLS handshake"
                                 f"{f' ({tls})' if tls is not None else ', it answers plaintext Redis'}: use "
                                 f"{'redis+cluster://' if 'cluster' in url.split('://')[0] else 'redis://'} without ssl "
                                 "for a plaintext server, or turn TLS on in the server (tls-port)") from e
        finally:
            client.close()


def _speaks_plaintext(host: str, port: int) -> bool:
    """Whether `host:port` answers a plaintext PING as Redis does (+PONG, or -NOAUTH/-ERR): a
    plaintext server sits waiting through a TLS client's handshake until it times out."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as plain:
            plain.sendall(b"PING\r\n")
            reply = plain.recv(16)
    except OSError:
        return False
    return reply[:1] in (b"+", b"-")


def _cluster_ok(client: Any) -> bool:
    info = client.execute_command("CLUSTER INFO")
    if isinstance(info, dict):
        return str(info.get("cluster_state")) == "ok"
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text


def _frame_pool(kwargs: dict[str, Any], db: int, username: str | None, password: str | None) -> FramePool:
    return FramePool(db=int(db or 0), username=username or kwargs.get("username"),
                     password=password or kwargs.get("password"), timeout=kwargs["socket_timeout"],
                     connect_timeout=kwargs["socket_connect_timeout"])
