"""Every redis-py failure, from every store call, comes out as a kvrag error: a client that fails
on its Nth command (with each exception redis-py defines, and the socket's) drives every public
method of a Redis store. An outage is one warning, and one line when the store answers again."""

from __future__ import annotations

import logging
import re
import socket
from pathlib import Path
from typing import Any

import pytest
import redis

from kvrag.errors import KVRagError, StoreError, StoreUnavailableError
from kvrag.stores import Accepted, Breaker, RedisStore
from kvrag.stores.redis.client import _unreachable_errors

KEY = "ab" * 32
BLOB = "memo/" + "cd" * 32
MANIFEST = b'{"payload_chunk_bytes": 4096}'


def _exceptions() -> list[BaseException]:
    """One instance of each exception type redis-py defines, and the socket's own."""
    made = []
    for kind in vars(redis.exceptions).values():
        if isinstance(kind, type) and issubclass(kind, Exception) and kind.__module__.startswith("redis"):
            try:
                made.append(kind("3999 127.0.0.1:1"))  # what a redirection's reply carries; any text else
            except TypeError:  # one that takes other arguments
                made.append(kind("injected", "injected"))
    return [*made, ConnectionRefusedError(111, "injected"), socket.timeout("injected")]


EXCEPTIONS = _exceptions()


class FailingClient:
    """A real client whose commands (and pipelines' `execute`) raise `error` from the `after`th on."""

    def __init__(self, real: Any, error: BaseException, after: int) -> None:
        self._real, self._error, self._left = real, error, after

    def _spend(self) -> None:
        if self._left <= 0:
            raise self._error
        self._left -= 1

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._real, name)
        if not callable(attribute):
            return attribute
        if name == "pipeline":
            return lambda *a, **k: FailingClient(attribute(*a, **k), self._error, self._left)

        def call(*args: Any, **kwargs: Any) -> Any:
            if name not in ("set", "get", "delete") or not isinstance(self._real, redis.client.Pipeline):
                self._spend()  # a pipeline's queued commands run at `execute`
            return attribute(*args, **kwargs)

        return call


class _Any:
    """An acceptance that takes any manifest and payload (the store's own calls are under test)."""

    def manifest(self, raw: bytes, store: Any) -> Accepted:
        return Accepted(raw)

    def payload(self, manifest: Any, payload: Any) -> bytes:
        return bytes(payload)


def _calls(store: RedisStore) -> dict[str, Any]:
    return {
        "read": lambda: store.read(KEY),
        "read accepted": lambda: store.read(KEY, lambda raw: Accepted(raw)),
        "read_manifest": lambda: store.read_manifest(KEY),
        "get_frame_table": lambda: store.get_frame_table(KEY),
        "holds": lambda: store.holds(KEY),
        "contains": lambda: KEY in store,
        "fetch": lambda: store.fetch(KEY, _Any()),
        "put": lambda: store.put(KEY, MANIFEST, b"x" * 10000),
        "delete": lambda: store.delete(KEY),
        "keys": lambda: list(store.keys()),
        "orphan_frames": lambda: store.orphan_frames(),
        "delete_raw": lambda: store.delete_raw([f"kvrag:{{{KEY}}}:f:0:0"]),
        "get_blob": lambda: store.get_blob(BLOB),
        "fetch_blob": lambda: store.fetch_blob(BLOB),
        "put_blob": lambda: store.put_blob(BLOB, b"record"),
        "delete_blob": lambda: store.delete_blob(BLOB),
        "blob_names": lambda: list(store.blob_names("memo")),
        "close": lambda: store.close(),
    }


def _store(server_url: str, make_client: Any) -> RedisStore:
    store = RedisStore(make_client, url=server_url, frame_bytes=4096)
    store.__dict__["_breaker"] = Breaker(cooldown_s=0.0, name=server_url)  # every call reaches the client
    return store


@pytest.fixture(scope="module")
def stocked(tmp_path_factory):
    """A Redis holding one state and one blob, so that calls get past their first command."""
    from kvrag.testing import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("faults")).start()
    healthy = RedisStore(lambda: redis.Redis.from_url(server.url), url=server.url, frame_bytes=4096)
    healthy.put(KEY, MANIFEST, b"x" * 10000)
    healthy.put_blob(BLOB, b"record")
    yield server
    server.stop()


@pytest.mark.parametrize("error", EXCEPTIONS, ids=lambda e: type(e).__name__)
def test_no_redis_py_exception_leaves_any_store_method(stocked, error):
    real = redis.Redis.from_url(stocked.url)
    seen = 0
    for after in (0, 1, 2, 3):
        for name, call in _calls(_store(stocked.url, lambda: FailingClient(real, error, after))).items():
            try:
                call()
            except KVRagError as e:
                seen += 1
                if isinstance(error, _unreachable_errors()):
                    assert isinstance(e, StoreUnavailableError), (name, after, e)
                assert type(error).__name__ in str(e) or "skipped" in str(e), (name, after, e)
            except Exception as e:  # noqa: BLE001 - the failure under test
                pytest.fail(f"{name} (failing from command {after}) let {type(e).__module__}.{type(e).__name__} out: {e}")
    assert seen >= len(_calls(_store(stocked.url, lambda: None))) - 3  # most calls met the fault


def test_a_client_that_cannot_be_made_is_a_store_error_too(stocked):
    def refuse() -> Any:
        raise redis.exceptions.RedisClusterException("Redis Cluster cannot be connected (injected)")

    store = _store(stocked.url, refuse)
    for name, call in _calls(store).items():
        if name in ("holds", "contains", "close"):
            assert call() in (False, None)
            continue
        with pytest.raises(StoreUnavailableError):
            call()


def test_an_outage_is_one_warning_and_its_end_one_line(stocked, caplog):
    real = redis.Redis.from_url(stocked.url)
    failing = [True]

    class Flaky(FailingClient):
        def _spend(self) -> None:
            if failing[0]:
                raise redis.exceptions.ConnectionError("injected: the server went away")

    url = stocked.url + "?outage=1"  # its own name: no other test's outage on the same URL
    store = _store(url, lambda: Flaky(real, redis.exceptions.ConnectionError(), 0))
    with caplog.at_level(logging.INFO, logger="kvrag"):
        for _ in range(3):
            for name, call in _calls(store).items():
                if name != "close":
                    try:
                        call()
                    except StoreError:
                        pass
        failing[0] = False
        for _ in range(2):
            assert store.get_blob(BLOB) == b"record" and store.holds(KEY)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 2, lines
    assert "is unavailable" in lines[0] and "ConnectionError" in lines[0]
    assert lines[1].endswith("answers again: its states are grafted again")
    # the Redis guide shows these two lines as the command line writes them
    guide = (Path(__file__).parents[2] / "docs" / "guides" / "redis.md").read_text(encoding="utf-8")
    shown = guide.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    def shape(line: str) -> str:  # the URL and what failed vary; the sentence does not
        return re.sub(r"\(.*?\):", "(WHY):", re.sub(r"^\S+ ", "URL ", line), count=1)
    assert [shape(line.removeprefix("kvrag: warning: ")) for line in shown] == [shape(line) for line in lines]
