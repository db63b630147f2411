"""A run of states (a prompt's blocks, in order) in few round trips: whether the server holds them
(`holds_run`: every frame table, then every frame's presence), and their payloads received
straight into the caller's memory over one connection of kvrag's own, every frame table in one
round trip, every frame two requests ahead, each chunk checked where it lies (`receive_run`).

A paged engine (vLLM) reads a request's blocks this way into its own cache: no buffer of kvrag's,
no copy after the checks. The reads run in the caller's thread, bounded by its deadline, so nothing
writes into the caller's memory once a run returns; what a state that did not land left there is
undefined, and the caller computes it again.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from typing import Any, Sequence

from kvrag.artifacts.digests import ChunkOpener, hash_pool, spans
from kvrag.errors import (
    IntegrityError,
    RedirectError,
    StateError,
    StateNotFoundError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from kvrag.stores.base import UNTRUSTED_PARSE_ERRORS, Receive
from kvrag.stores.deadline import Deadline
from kvrag.stores.outages import answered, public_url
from kvrag.stores.redis.frames import FrameTable, parse_frame_table
from kvrag.stores.redis.wire import FramePool

__all__ = ["RunReads"]

#: frame requests a run's connection keeps ahead of the frame being received
_AHEAD = 2

_Planned = tuple[Receive, FrameTable, ChunkOpener]


class RunReads:
    """`RedisStore.holds_run` and `RedisStore.receive_run` (see the module docstring), over the
    store's client, key names, guard and frame pool."""

    url: str
    cluster: bool
    max_state_bytes: int
    frame_pool: FramePool | None
    client: Any
    breaker: Any
    _node: tuple[str, int] | None

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
        planned: list[_Planned] = []
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
        try:
            groups = self._by_node(planned)
        except StoreError as e:  # the cluster's slot map could not be read: none is received in place
            return 0, e.located(reads[0].key, self.url) if isinstance(e, StateError) else e
        landed, error = 0, None
        for group in groups:
            done, error = self._receive(group, deadline, what)
            landed += done
            if error is not None:
                break
        return landed, error if error is not None else stop

    def _by_node(self, planned: list[_Planned]) -> list[list[_Planned]]:
        """The planned states in runs that one server holds (a cluster spreads them over its nodes)."""
        groups: list[list[_Planned]] = []
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
        frame_table.check_lists(chunking, read.key)
        size = sum(len(piece) for piece in read.pieces)
        if size != chunking.size:
            raise IntegrityError(f"state {read.key[:12]} is {chunking.size} bytes, not the {size} bytes it is read into")
        if not chunking.chunk_opener.in_place:
            raise StoreError(f"state {read.key[:12]} is sealed: its chunks open into a buffer of their own (use fetch)")
        return frame_table, chunking.chunk_opener

    def _receive(self, planned: list[_Planned], deadline: Deadline | None,
                 what: str) -> tuple[int, Exception | None]:
        """The frames of the planned states, received in order (see `receive_run`)."""
        assert self.frame_pool is not None
        frames = [(state, index, name, spans(read.pieces, index * table.frame_bytes,
                                             index * table.frame_bytes + table.frame_length(index)))
                  for state, (read, table, _) in enumerate(planned)
                  for index, name in enumerate(self._fkeys(read.key, table))]
        if not frames:
            return len(planned), None
        frame_pool, timeout = self.frame_pool, self.frame_pool.options.get("timeout", 5.0)
        host, port = self._node_of(frames[0][2])
        connection = frame_pool.take(host, port)
        checks: list[tuple[int, bool | Future[bool]]] = []
        inline = _check_inline()
        arrived, error, healthy = 0, None, False  # arrived: states whose every frame arrived
        try:
            asked = min(_AHEAD, len(frames))
            connection, _ = frame_pool.retried(host, port, connection, lambda c: c.ask(*(f[2] for f in frames[:asked])))
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
                opener = planned[state][2]
                checks.append((state, opener.check(index, pieces) if inline else hash_pool().submit(opener.check, index, pieces)))
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
            failed = [state for state, check in checks if not (check if isinstance(check, bool) else check.result())]
            if healthy:
                connection.sock.settimeout(timeout)
                frame_pool.give(host, port, connection)
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



def _check_inline() -> bool:
    """Whether a run's frames are checked in the reading thread as each lands (still in cache): on
    two cores or fewer, hashing threads would only take turns with the reader and the server."""
    return len(os.sched_getaffinity(0)) <= 2
