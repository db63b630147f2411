"""A Redis tier that heals and never downgrades: a restarted server is used again at once (the
breaker probes it, pooled connections it closed are replaced once), error replies of any length
are read as what they are, and a cluster asked for TLS speaks TLS or nothing."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import redis

from kvrag import KVEngine, StoreError
from kvrag.errors import IntegrityError, RedirectError
from kvrag.stores.redis.wire import FrameConnection
from kvrag.testing import RedisServer

from ..conftest import DOC_A, QUESTION, tiny
from .conftest import engine, text_logits


@pytest.mark.parametrize("wire", ["direct", "client"])
def test_a_restarted_redis_grafts_again_within_a_second_of_holding_the_state(tmp_path, wire):
    # keeps its data: every write on disk before its reply (with the default `everysec`, Redis may put
    # off writing its log while a slow disk syncs, so a kill can lose the state just stored)
    server = RedisServer(tmp_path / "redis", extra=("--appendonly", "yes", "--appendfsync", "always")).start()
    try:
        victim = engine(f"{server.url}?wire={wire}")
        ref = victim.deposit(DOC_A)
        assert victim.generate(QUESTION, states=[ref], max_new_tokens=1).receipt.mode == "exact-graft"
        server.stop(kill=True)
        down = victim.generate(QUESTION, states=[ref], max_new_tokens=1)
        assert down.receipt.mode == "text-prefill" and down.receipt.states[0].reason == "unavailable"
        assert down.receipt.first_token_logits_sha256 == text_logits()
        server.start()  # returns once it answers PING: the state is loaded from its append-only file
        back = time.monotonic()
        while True:
            answer = victim.generate(QUESTION, states=[ref], max_new_tokens=1)
            if answer.receipt.mode == "exact-graft" or time.monotonic() - back > 3:
                break
            time.sleep(0.05)
        healed = time.monotonic() - back
        assert answer.receipt.mode == "exact-graft" and healed < 1.0, (healed, victim.store.tiers[0].breaker,
                                                                       answer.receipt.states[0])
        assert answer.receipt.first_token_logits_sha256 == text_logits()
    finally:
        server.stop(kill=True)


def _one_reply_server(reply: bytes) -> tuple[socket.socket, int]:
    """A TCP server that answers each connection's first command with `reply`."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(4096)
            conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return listener, listener.getsockname()[1]


@pytest.mark.parametrize("reply, error", [
    (b"-LOADING Redis is loading the dataset in memory\r\n", StoreError),
    (b"-NOAUTH Authentication required.\r\n", StoreError),
    (b"-BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT.\r\n", StoreError),
    (b"-MOVED 3999 a-cluster-node-with-a-rather-long-host-name.internal.example.com:6379\r\n", RedirectError),
    (b"-ERR " + b"x" * 5000 + b"\r\n", IntegrityError),  # longer than any error line: not read on
    (b"$" + b"9" * 40 + b"\r\n", IntegrityError),  # a bulk header no frame has
])
def test_error_replies_of_any_length_are_read_as_what_they_are(reply, error):
    listener, port = _one_reply_server(reply)
    try:
        connection = FrameConnection.connect("127.0.0.1", port, timeout=2)
        with pytest.raises(error) as raised:
            connection.get_into("kvrag:{k}:f:0", memoryview(bytearray(16)))
        if error is StoreError:
            assert not isinstance(raised.value, (IntegrityError, RedirectError))
            assert "cannot serve now" in str(raised.value) and reply[1:20].decode() in str(raised.value)
        connection.close()
    finally:
        listener.close()


def test_ssl_true_on_a_plain_cluster_refuses_and_writes_nothing_in_plaintext(redis_cluster):
    port = redis_cluster.masters[0].port
    for url in (f"redis+cluster://127.0.0.1:{port}?ssl=true", f"rediss+cluster://127.0.0.1:{port}"):
        with pytest.raises(StoreError, match="does not complete a TLS handshake.*redis[+]cluster:// without ssl"):
            KVEngine(tiny("llama"), url, deadline_s=1.0)
    for master in redis_cluster.masters:  # not one byte of it reached the cluster
        assert redis.Redis(port=master.port).keys("kvrag:*") == []
    with pytest.raises(StoreError, match="does not take"):
        KVEngine(tiny("llama"), f"redis+cluster://127.0.0.1:{port}?ssl=true&sssl_ca_certs=/x")
