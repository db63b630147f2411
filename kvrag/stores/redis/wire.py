"""Frames read off a Redis socket straight into their place in the payload buffer.

redis-py (with hiredis) hands a `GET` reply back as a new `bytes` object: the kernel copies the
frame into the parser's buffer, the parser into the object (fresh pages, faulted in one by one),
and the store once more into the payload buffer. For states of tens of megabytes those copies cost
as much as the wire. `FrameConnection` sends the `GET` itself and `recv_into`s the bulk reply at
its offset in the payload buffer: one copy, by the kernel.

Replies are untrusted bytes: the header line is bounded, its length must be exactly the frame
length the signed manifest gives (anything else is an `IntegrityError`, and the connection, whose
stream position is then unknown, is closed), and every socket wait is bounded by a timeout. Only
plain TCP (or a Unix socket) with optional AUTH and SELECT is spoken here; TLS and anything else
stays with redis-py.
"""

from __future__ import annotations

import socket
import threading
from typing import Any, Callable, Sequence, TypeVar

from kvrag.errors import IntegrityError, RedirectError, StoreError

__all__ = ["FrameConnection", "FramePool"]

_MAX_HEADER = 32  # "$" + up to 20 digits + CRLF
_MAX_ERROR = 4096  # an error reply line ("-MOVED 1234 a-long-host-name:6379", "-LOADING ...")
#: error replies that mean the server cannot serve now (it is starting, loading, busy or locked):
#: an outage the breaker counts, never a verdict on the stored bytes
_UNAVAILABLE = (b"-LOADING", b"-NOAUTH", b"-BUSY", b"-TRYAGAIN", b"-CLUSTERDOWN", b"-MASTERDOWN", b"-READONLY",
                b"-WRONGPASS", b"-NOPERM")


T = TypeVar("T")


class RefusedError(StoreError):
    """The server answered a command with an error (out of memory, read-only, not allowed): it is
    up, the command was not done."""


def _command(*parts: str) -> bytes:
    """One Redis command in RESP: an array of bulk strings."""
    encoded = [p.encode() for p in parts]
    return b"*%d\r\n" % len(encoded) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in encoded)


class FrameConnection:
    """One connection of our own to one Redis server, used only for frames: read into place, and
    written from where they lie."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        #: taken from a pool, not yet used since: the server may have closed it meanwhile (a restart)
        self.reused = False

    @classmethod
    def connect(cls, host: str, port: int, *, db: int = 0, username: str | None = None, password: str | None = None,
                timeout: float = 5.0, connect_timeout: float = 1.0) -> "FrameConnection":
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
            sock.settimeout(timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            raise StoreError(f"cannot connect to {host}:{port}: {e}") from e
        connection = cls(sock)
        try:
            if password:
                connection._simple("AUTH", *([username] if username else []), password)
            if db:
                connection._simple("SELECT", str(db))
        except BaseException:
            connection.close()
            raise
        return connection

    def _send(self, *parts: str) -> None:
        self.sock.sendall(_command(*parts))

    def _line(self) -> bytes:
        """One CRLF-terminated reply line, without consuming a byte past it (the frame that follows
        is received into its own place): at most `_MAX_HEADER` bytes for a bulk header, at most
        `_MAX_ERROR` for an error line."""
        pending = b""
        while True:
            limit = _MAX_ERROR if pending[:1] == b"-" else _MAX_HEADER
            peeked = self.sock.recv(limit - len(pending), socket.MSG_PEEK)
            if not peeked:
                raise StoreError("Redis closed the connection mid-reply")
            joined = pending + peeked
            bound = _MAX_ERROR if joined[:1] == b"-" else _MAX_HEADER
            end = joined.find(b"\r\n")
            if 0 <= end <= bound - 2:
                self._exactly(end + 2 - len(pending))
                return joined[:end]
            if len(joined) >= bound:
                raise IntegrityError("a Redis reply line is longer than any reply kvrag reads")
            pending += self._exactly(len(peeked))  # no CRLF yet: all of it is the line

    def _simple(self, *command: str) -> None:
        try:
            self._send(*command)
            line = self._line()
        except OSError as e:
            raise StoreError(f"Redis {command[0]} failed: {e}") from e
        if not line.startswith(b"+"):
            raise StoreError(f"Redis refused {command[0]}: {line[:200].decode(errors='replace')}")

    def get_into(self, name: str, target: memoryview | Sequence[memoryview]) -> bool:
        """`GET name` into `target`; False if there is no such key. The reply must be exactly
        `len(target)` bytes long (else `IntegrityError`)."""
        self.ask(name)
        return self.reply_into(target)

    def ask(self, *names: str) -> None:
        """Send `GET name` for each name, pipelined: read the replies in order with `reply_into`."""
        try:
            self.sock.sendall(b"".join(_command("GET", name) for name in names))
        except OSError as e:
            raise StoreError(f"asking for a frame failed: {type(e).__name__}: {e}") from e

    def set_many(self, items: Sequence[tuple[str, memoryview]], ttl: int | None = None) -> None:
        """`SET name value [EX ttl]` for each item, pipelined, each value sent from where it lies
        (never copied into a command buffer); every reply must be `+OK` (a moved slot raises
        `RedirectError`)."""
        tail = b"\r\n" + (b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl)), ttl) if ttl else b"")
        try:
            for name, value in items:
                key = name.encode()
                self.sock.sendall(b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (5 if ttl else 3, len(key), key,
                                                                                  len(value)))
                self.sock.sendall(value)
                self.sock.sendall(tail)
            for _ in items:
                line = self._line()
                if line.startswith((b"-MOVED ", b"-ASK ")):
                    raise RedirectError(f"Redis redirected the write: {line[1:300].decode(errors='replace')}")
                if line != b"+OK":
                    raise RefusedError(f"Redis refused a frame: {line[:300].decode(errors='replace')}")
        except OSError as e:
            raise StoreError(f"writing a frame failed: {type(e).__name__}: {e}") from e

    def reply_into(self, target: memoryview | Sequence[memoryview]) -> bool:
        """The next `GET` reply into `target` (a byte view, or byte views filled in order); False for a
        missing key. The reply must be exactly as long as the target (else `IntegrityError`)."""
        pieces = [target] if isinstance(target, memoryview) else list(target)
        try:
            line = self._line()
            if line.startswith((b"-MOVED ", b"-ASK ")):
                raise RedirectError(f"Redis redirected the read: {line[1:300].decode(errors='replace')}")
            if line.startswith(_UNAVAILABLE):
                raise StoreError(f"Redis cannot serve now: {line[1:300].decode(errors='replace')}")
            if line.startswith(b"-"):
                raise StoreError(f"Redis GET failed: {line[1:300].decode(errors='replace')}")
            if line == b"$-1":
                return False
            if not line.startswith(b"$") or not line[1:].isdigit():
                raise IntegrityError("a Redis reply is not a bulk string")
            length, expected = int(line[1:]), sum(len(piece) for piece in pieces)
            if length != expected:
                raise IntegrityError(f"a frame is {length} bytes, expected {expected}")
            for piece in pieces:
                got = 0
                while got < len(piece):
                    n = self.sock.recv_into(piece[got:], len(piece) - got)
                    if n == 0:
                        raise StoreError("Redis closed the connection mid-frame")
                    got += n
            if self._exactly(2) != b"\r\n":
                raise IntegrityError("a Redis bulk reply is not terminated by CRLF")
            return True
        except OSError as e:
            raise StoreError(f"reading a frame failed: {type(e).__name__}: {e}") from e

    def _exactly(self, count: int) -> bytes:
        data = bytearray()
        while len(data) < count:
            chunk = self.sock.recv(count - len(data))
            if not chunk:
                raise StoreError("Redis closed the connection mid-reply")
            data += chunk
        return bytes(data)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class FramePool:
    """Idle `FrameConnection`s per server, reused; a connection that failed in any way is closed
    instead of returned (its position in the reply stream is unknown)."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self._idle: dict[tuple[str, int], list[FrameConnection]] = {}
        self._lock = threading.Lock()

    def take(self, host: str, port: int) -> FrameConnection:
        """An idle connection (`reused`), else a new one."""
        with self._lock:
            idle = self._idle.get((host, port))
            if idle:
                connection = idle.pop()
                connection.reused = True
                return connection
        return self.connect(host, port)

    def connect(self, host: str, port: int) -> FrameConnection:
        return FrameConnection.connect(host, port, **self.options)

    def retried(self, host: str, port: int, connection: FrameConnection,
                use: Callable[[FrameConnection], T]) -> tuple[FrameConnection, T]:
        """`use(connection)`; if it fails on a pooled connection the server closed since (a
        restart), `use` on one fresh connection, once. The connection used, and what `use` gave.
        An answer from the server (a redirection, a refusal) is never retried."""
        try:
            result = use(connection)
        except (RedirectError, RefusedError):
            raise
        except StoreError:
            if not connection.reused:
                raise
            connection.close()
            connection = self.connect(host, port)
            result = use(connection)
        connection.reused = False
        return connection, result

    def give(self, host: str, port: int, connection: FrameConnection) -> None:
        with self._lock:
            self._idle.setdefault((host, port), []).append(connection)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()
