"""Read buffers over kept pages (`kvrag.artifacts.pages`): a region serves a new buffer only once
every buffer, view and tensor over its last one is gone, never two live buffers, never across a fork."""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

from kvrag.artifacts.digests import CheckedBuffer
from kvrag.artifacts.pages import MIN_WARM_BYTES, REGION_STEP, WarmPages, warm_pages

SIZE = 3 * MIN_WARM_BYTES + 123


class Buffer(mmap.mmap):
    pass


def _fd_of(pool: WarmPages, buffer: object) -> int:
    (region,) = [r for r in pool._regions if r.user is not None and r.user() is buffer]
    return region.fd


def test_a_dead_buffers_region_serves_the_next_read_with_its_pages() -> None:
    pool = WarmPages(64 << 20)
    first = pool.map(Buffer, SIZE)
    first[:4] = b"abcd"
    fd = _fd_of(pool, first)
    del first
    gc.collect()
    second = pool.map(Buffer, SIZE - 1000)
    assert _fd_of(pool, second) == fd and len(pool) == 1
    assert second[:4] == b"abcd"  # the same resident pages (a read overwrites every byte it uses)


def test_live_buffers_never_share_a_region() -> None:
    pool = WarmPages(64 << 20)
    a, b = pool.map(Buffer, SIZE), pool.map(Buffer, SIZE)
    assert len(pool) == 2 and _fd_of(pool, a) != _fd_of(pool, b)
    a[:] = b"\x01" * SIZE
    b[:] = b"\x02" * SIZE
    assert a[:] == b"\x01" * SIZE


def test_a_tensor_over_a_buffer_keeps_its_region_from_reuse() -> None:
    pool = WarmPages(64 << 20)
    buffer = pool.map(Buffer, SIZE)
    buffer[:] = b"\x07" * SIZE
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)
    view = memoryview(buffer)[:16]
    del buffer
    gc.collect()
    other = pool.map(Buffer, SIZE)
    other[:] = b"\x09" * SIZE
    assert len(pool) == 2
    assert bool((tensor == 7).all()) and view.tobytes() == b"\x07" * 16


def test_the_pool_stays_within_its_budget_and_small_buffers_take_fresh_memory() -> None:
    pool = WarmPages(2 * REGION_STEP)
    assert pool.map(Buffer, MIN_WARM_BYTES - 1) is None
    assert pool.map(Buffer, 2 * REGION_STEP + 1) is None
    held = pool.map(Buffer, REGION_STEP)
    assert pool.map(Buffer, REGION_STEP + 1) is None  # would take 2 steps more: over the budget
    assert pool.held <= pool.budget and held is not None
    del held
    gc.collect()
    bigger = pool.map(Buffer, REGION_STEP + 1)  # the free region is closed to make room
    assert bigger is not None and pool.held == 2 * REGION_STEP and len(pool) == 1
    assert WarmPages(0).map(Buffer, SIZE) is None


def test_a_buffer_mapped_at_a_fork_is_never_reused_and_the_child_keeps_nothing() -> None:
    pool = warm_pages()
    live = CheckedBuffer(SIZE)
    live[:] = b"\x05" * SIZE
    mapped = [r for r in pool._regions if r.user is not None and r.user() is live]
    if not mapped:
        pytest.skip("this process's pool could not serve the buffer (budget or no memfd)")
    free_before = [r.fd for r in pool._regions if r.free]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's regions are gone; its own buffers are its own
        try:
            os.close(read)
            ok = len(pool) == 0 and live[:1] == b"\x05"
            mine = CheckedBuffer(SIZE)
            mine[:] = b"\x06" * SIZE
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.waitpid(pid, 0)
    os.close(read)
    assert answer == b"1"
    assert mapped[0] not in pool._regions  # retired: the child held that mapping too
    assert [r.fd for r in pool._regions if r.free] == free_before
    del live
    gc.collect()
    fresh = CheckedBuffer(SIZE)
    fresh[:] = b"\x08" * SIZE
    assert fresh[:1] == b"\x08"
