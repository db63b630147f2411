"""A state written to Redis: its frames (one per chunk of the signed manifest, each listed by the
manifest's digest), then its frame table last, so a reader never finds a frame table whose frames
are not all written. The frames go out over a connection of kvrag's own, each sent from where it
lies (redis-py would copy every frame into a command buffer first); a moved cluster slot is
written by redis-py, which follows it."""

from __future__ import annotations

import json
import re
import time
from typing import Any

from kvrag.artifacts.digests import stored_form
from kvrag.errors import RedirectError, StoreError, StoreUnavailableError
from kvrag.stores.outages import public_url
from kvrag.stores.redis.frames import make_frame_table
from kvrag.stores.redis.wire import FramePool, RefusedError

__all__ = ["FrameWrites"]

_DIGEST = re.compile(r"[0-9a-f]{64}")


class FrameWrites:
    """`RedisStore.put` (see the module docstring), over the store's client, key names, guard and
    frame pool."""

    url: str
    ttl: int | None
    frame_bytes: int
    frame_pool: FramePool | None
    client: Any
    breaker: Any

    def put(self, key: str, manifest: bytes, payload: Any) -> None:
        # One frame per chunk of the manifest, so a reader checks frames against the signed chunk digests.
        payload = stored_form(payload)  # a sealed state promoted here: its stored bytes, never its plaintext
        frame_table, frames = make_frame_table(manifest, payload, *_chunking(manifest, self.frame_bytes))
        keys = self._fkeys(key, frame_table)

        def write() -> None:
            if self.frame_pool is None or not self._write_direct(keys, frames):
                pipe = self.client.pipeline(transaction=False)
                for name, frame in zip(keys, frames):
                    pipe.set(name, frame.tobytes() if len(frames) > 1 else bytes(frame), ex=self.ttl)
                pipe.execute()
            # The frame table last: a reader never finds a frame table whose frames are not all written.
            self.client.set(self._mkey(key), frame_table.model_dump_json(), ex=self.ttl)

        self._call("SET", write)

    def _write_direct(self, names: list[str], frames: list[memoryview]) -> bool:
        """The frames written over a connection of our own to the node that holds them, each sent
        from where it lies; False where the slot moved (redis-py writes them, and follows it)."""
        assert self.frame_pool is not None
        if not names:
            return True
        pool = self.frame_pool
        host, port = self._node_of(names[0])
        connection, healthy = pool.take(host, port), False
        items = list(zip(names, frames))
        try:
            connection, _ = pool.retried(host, port, connection, lambda c: c.set_many(items, self.ttl))
            healthy = True
            return True
        except RedirectError:
            return False
        except RefusedError as e:
            raise StoreError(f"SET frames failed on {public_url(self.url)}: {e}") from e
        except StoreError as e:
            self.breaker.trip(f"{e} at {time.strftime('%H:%M:%S')}")
            raise StoreUnavailableError(str(e), tier=self.url) from e
        finally:
            (pool.give(host, port, connection) if healthy else connection.close())


def _chunking(manifest: bytes, default: int) -> tuple[int, list[str] | None]:
    """The chunk size a manifest declares (frames are its chunks) and its chunks' digests, where it
    declares both well formed; else `default` and None (the frames are digested here)."""
    try:
        fields = json.loads(manifest)
        size, digests = fields.get("payload_chunk_bytes"), fields.get("payload_chunks")
    except (ValueError, AttributeError, RecursionError):
        return default, None
    if not (isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= 1 << 30):
        return default, None
    if not (isinstance(digests, list) and all(isinstance(d, str) and _DIGEST.fullmatch(d) for d in digests)):
        return size, None
    return size, digests
