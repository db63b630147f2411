"""What a Redis server (or whoever answers in its place) can send back to the direct frame reader:
any bytes at all. The reader accepts exactly one well-formed bulk reply of exactly the frame's
length, and for anything else raises a typed error (or reports a miss), never crashes, never
writes past the frame's slot and never waits without bound."""

from __future__ import annotations

import socket
import threading

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrag.errors import IntegrityError, StoreError
from kvrag.stores.redis.wire import FrameConnection

FRAME = 64


def answer(reply: bytes, close: bool = True) -> tuple[FrameConnection, threading.Thread]:
    """A connection whose peer swallows the request and sends `reply`."""
    ours, theirs = socket.socketpair()
    ours.settimeout(0.5)

    def peer() -> None:
        try:
            theirs.recv(4096)
            theirs.sendall(reply)
        finally:
            if close:
                theirs.close()

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    return FrameConnection(ours), thread


def read(reply: bytes, close: bool = True, cuts: list[int] | None = None) -> tuple[object, bytearray]:
    """The outcome of reading `reply` into a frame's slot (cut into pieces at `cuts`, filled in
    order), and the buffer around it."""
    buffer = bytearray(b"\xee" * (FRAME + 16))
    view, edges = memoryview(buffer), [0, *sorted(set(c for c in cuts or [] if 0 < c < FRAME)), FRAME]
    pieces = [view[a:b] for a, b in zip(edges, edges[1:])]
    connection, thread = answer(reply, close)
    try:
        outcome: object = connection.get_into("k", pieces[0] if cuts is None else pieces)
    except (IntegrityError, StoreError) as e:
        outcome = type(e)
    finally:
        connection.close()
        thread.join(2)
    return outcome, buffer


def test_a_well_formed_reply_lands_in_its_slot_and_nothing_else_changes():
    frame = bytes(range(FRAME))
    outcome, buffer = read(b"$%d\r\n" % FRAME + frame + b"\r\n")
    assert outcome is True and bytes(buffer[:FRAME]) == frame and bytes(buffer[FRAME:]) == b"\xee" * 16


def test_a_missing_key_is_a_miss():
    assert read(b"$-1\r\n")[0] is False


def test_wrong_lengths_errors_and_garbage_are_typed_errors():
    for reply in (b"$%d\r\n" % (FRAME + 1) + b"x" * (FRAME + 3), b"$%d\r\n" % (FRAME - 1) + b"x" * (FRAME + 1),
                  b"-ERR wrong\r\n", b"+OK\r\n", b"$" + b"9" * 40 + b"\r\n", b"*1\r\n$1\r\nx\r\n",
                  b"$%d\r\n" % FRAME + b"x" * FRAME + b"ab", b"$%d\r\n" % FRAME + b"x" * 10, b""):
        outcome, buffer = read(reply)
        assert outcome in (IntegrityError, StoreError), reply
        assert bytes(buffer[FRAME:]) == b"\xee" * 16


def test_a_peer_that_sends_half_a_reply_and_stalls_costs_the_timeout_only():
    outcome, _ = read(b"$%d\r\n" % FRAME + b"x" * 10, close=False)
    assert outcome is StoreError


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200) | st.builds(lambda n, body: b"$%d\r\n" % n + body,
                                           st.integers(-3, FRAME + 3), st.binary(max_size=FRAME + 8)))
def test_any_reply_is_a_frame_a_miss_or_a_typed_error(reply):
    outcome, buffer = read(reply)
    assert outcome in (True, False, IntegrityError, StoreError)
    assert bytes(buffer[FRAME:]) == b"\xee" * 16
    if outcome is True:
        assert reply == b"$%d\r\n" % FRAME + bytes(buffer[:FRAME]) + b"\r\n"


def test_a_cluster_redirection_is_its_own_error():
    from kvrag.errors import RedirectError

    connection, thread = answer(b"-MOVED 3999 127.0.0.1:7002\r\n")
    try:
        try:
            connection.get_into("k", memoryview(bytearray(FRAME)))
        except RedirectError:
            pass
        else:
            raise AssertionError("a MOVED reply was taken for a frame")
    finally:
        connection.close()
        thread.join(2)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, FRAME), max_size=6),
       st.binary(min_size=FRAME, max_size=FRAME) | st.binary(max_size=FRAME + 8))
def test_a_frame_received_in_pieces_fills_them_in_order_or_is_a_typed_error(cuts, body):
    reply = b"$%d\r\n" % len(body) + body + b"\r\n"
    outcome, buffer = read(reply, cuts=cuts)
    assert bytes(buffer[FRAME:]) == b"\xee" * 16  # never past the pieces
    if len(body) == FRAME:
        assert outcome is True and bytes(buffer[:FRAME]) == body
    else:
        assert outcome is IntegrityError


def test_pipelined_replies_each_land_in_their_own_target():
    frames = [bytes([i]) * FRAME for i in range(3)]
    connection, thread = answer(b"".join(b"$%d\r\n" % FRAME + f + b"\r\n" for f in frames) + b"$-1\r\n")
    try:
        connection.ask("a", "b", "c", "d")
        targets = [bytearray(FRAME) for _ in frames]
        assert all(connection.reply_into(memoryview(t)) for t in targets)
        assert connection.reply_into(memoryview(bytearray(FRAME))) is False
        assert [bytes(t) for t in targets] == frames
    finally:
        connection.close()
        thread.join(2)


def write(reply: bytes, count: int = 2) -> object:
    """The outcome of writing `count` small frames to a peer that takes the whole request, checks
    it is those SETs in RESP, then answers `reply` and closes."""
    items = [(f"f{i}", bytes([i]) * 8) for i in range(count)]
    request = b"".join(b"*5\r\n$3\r\nSET\r\n$2\r\n%s\r\n$8\r\n%s\r\n$2\r\nEX\r\n$2\r\n60\r\n" % (n.encode(), v)
                       for n, v in items)
    ours, theirs = socket.socketpair()
    ours.settimeout(0.5)
    received = bytearray()

    def peer() -> None:
        try:
            while len(received) < len(request) and (data := theirs.recv(4096)):
                received.extend(data)
            theirs.sendall(reply)
        finally:
            theirs.close()

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    connection = FrameConnection(ours)
    try:
        connection.set_many([(n, memoryview(v)) for n, v in items], ttl=60)
        return True
    except (IntegrityError, StoreError) as e:
        return type(e)
    finally:
        connection.close()
        thread.join(2)
        assert bytes(received) == request


def test_a_frame_write_is_done_only_when_every_frame_is_ok():
    from kvrag.errors import RedirectError
    from kvrag.stores.redis.wire import RefusedError

    assert write(b"+OK\r\n+OK\r\n") is True
    assert write(b"+OK\r\n-OOM command not allowed\r\n") is RefusedError
    assert write(b"-MOVED 3999 127.0.0.1:7002\r\n+OK\r\n") is RedirectError
    assert write(b"+OK\r\n") is StoreError  # the server went away before the second answer


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=120) | st.lists(st.sampled_from([b"+OK\r\n", b"-ERR no\r\n", b"+OKAY\r\n", b"$2\r\nOK\r\n",
                                                          b"-ASK 1 h:1\r\n", b"\r\n"]), max_size=3).map(b"".join))
def test_any_answer_to_a_frame_write_is_done_or_a_typed_error(reply):
    outcome = write(reply)
    assert outcome in (True, StoreError, IntegrityError) or issubclass(outcome, StoreError)
    if outcome is True:  # what follows is the next command's (a stray reply fails that one, typed)
        assert reply.startswith(b"+OK\r\n+OK\r\n")
