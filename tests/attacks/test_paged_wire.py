"""Blocks received straight into the caller's tensors (a paged engine's cache) from a real Redis:
what a writer of the store can do to them. A block that lands is bit-equal to what was saved; a
flipped byte, a missing or resized frame, another block's frame table or garbage is refused with its
reason and counted; a stalled server costs the deadline, and nothing writes into the caller's
tensors once the load has returned. `holds_run` stops where a block stops being whole."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis
import torch

from kvrag.errors import IntegrityError, StateError, StateNotFoundError, StoreUnavailableError
from kvrag.paged import BlockEngine, BlockLayer, BlockStore
from kvrag.stores import open_store
from kvrag.stores.redis import runs
from kvrag.testing import RedisServer

KEY = b"k" * 32
ENGINE = BlockEngine({"vllm": "0.32.0", "model": "m", "block_size": "16", "layout": "BHTC"})
#: frames of 1 MiB: a block of 3 layers of [4, 16, 1024] float32 (768 KiB) spans... one frame; of
#: [8, 16, 1024] (1.5 MiB) two, so a frame straddles the layers' tensors
FRAME_MIB = 1


@pytest.fixture(params=["in the reading thread", "on the hashing threads"])
def checks(request, monkeypatch):
    """Both ways a run checks its frames (the reading thread on two cores or fewer, else the
    hashing threads), whatever this machine's cores."""
    monkeypatch.setattr(runs, "_check_inline", lambda: request.param == "in the reading thread")
    return request.param


def _cache(dtype: torch.dtype = torch.float32, blocks: int = 6) -> list[torch.Tensor]:
    """Three layers of a paged cache laid out as vLLM's CPU backend lays it (block, head, token, 2 x head size)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(blocks, 8, 16, 1024, generator=gen).to(dtype) for _ in range(3)]


def _views(cache: list[torch.Tensor], index: int) -> list[torch.Tensor]:
    return [layer.select(0, index) for layer in cache]


def _setup(server: RedisServer, dtype: torch.dtype = torch.float32) -> tuple[BlockStore, list, list[torch.Tensor]]:
    store = open_store(f"{server.url}?frame_mib={FRAME_MIB}")
    blocks = BlockStore(store, ENGINE, KEY, deadline_s=2.0)
    chain = blocks.chain(list(range(48)), 16)
    cache = _cache(dtype)
    for index, block in enumerate(chain):
        blocks.save(block, _views(cache, index))
    return blocks, chain, cache


def _layers(cache: list[torch.Tensor]) -> list[BlockLayer]:
    return [BlockLayer.of(str(i), view) for i, view in enumerate(_views(cache, 0))]


def _client(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port)


def _frames(server: RedisServer, key: str) -> list[bytes]:
    return sorted(_client(server).keys(f"kvrag:{{{key}}}:f:*"), key=lambda name: int(name.rsplit(b":", 1)[1]))


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_land_in_the_callers_tensors_bit_for_bit(server, dtype, checks):
    blocks, chain, cache = _setup(server, dtype)
    assert len(_frames(server, chain[0].key)) == (2 if dtype == torch.float32 else 1)
    for index, block in enumerate(chain):
        assert blocks.load_into(block, _views(cache, 3 + index), _layers(cache)) == blocks.store.url
        assert _equal(_views(cache, 3 + index), _views(cache, index))
    assert blocks.stats.loaded[blocks.store.url] == 3 and not blocks.stats.refused
    # a target that is not one contiguous tensor is read whole, checked, then copied: the same bits
    strided = [torch.zeros(16, 8, 1024, dtype=dtype).transpose(0, 1) for _ in range(3)]
    blocks.load_into(chain[1], strided, _layers(cache))
    assert _equal(strided, _views(cache, 1))


def test_a_flipped_byte_a_missing_or_resized_frame_and_another_blocks_frame_table_are_refused(server, checks):
    blocks, chain, cache = _setup(server)
    client = _client(server)
    first, second = _frames(server, chain[0].key)
    raw = bytearray(client.get(second))
    raw[len(raw) // 2] ^= 1
    client.set(second, bytes(raw))
    with pytest.raises(IntegrityError):
        blocks.load_into(chain[0], _views(cache, 3), _layers(cache))
    client.set(second, bytes(raw[:-1]))
    with pytest.raises(IntegrityError):
        blocks.load_into(chain[0], _views(cache, 3), _layers(cache))
    client.delete(first)
    with pytest.raises(StateNotFoundError):
        blocks.load_into(chain[0], _views(cache, 3), _layers(cache))
    client.set(f"kvrag:{{{chain[1].key}}}:m", client.get(f"kvrag:{{{chain[2].key}}}:m"))
    with pytest.raises(IntegrityError, match="manifest of block"):
        blocks.load_into(chain[1], _views(cache, 4), _layers(cache))
    client.set(f"kvrag:{{{chain[2].key}}}:m", b"\x00not json")
    with pytest.raises(IntegrityError):
        blocks.load_into(chain[2], _views(cache, 5), _layers(cache))
    assert blocks.stats.refused == {"integrity": 4, "missing": 1}
    # the connection the refusals closed, or gave back, still reads: the untouched blocks land
    fresh = BlockStore(blocks.store, ENGINE, KEY)
    restored = fresh.chain(list(range(48)), 16)
    assert fresh.held(restored) == 0  # block 0 lost a frame: the run stops at it


@pytest.mark.parametrize("stall", ["before the frame table", "after the frame table"])
def test_a_stalled_server_costs_the_deadline_and_nothing_writes_after_it(server, monkeypatch, stall, checks):
    blocks, chain, cache = _setup(server)
    target = [torch.zeros(8, 16, 1024) for _ in range(3)]
    pid = server.process.pid
    if stall == "before the frame table":
        os.kill(pid, signal.SIGSTOP)
    else:  # the frame table arrives, then the server stops: the frames' waits are bounded too
        read = type(blocks.store)._frame_tables
        monkeypatch.setattr(type(blocks.store), "_frame_tables",
                            lambda self, keys: (read(self, keys), os.kill(pid, signal.SIGSTOP))[0])
    try:
        began = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            BlockStore(blocks.store, ENGINE, KEY, deadline_s=0.5).load_into(chain[0], target, _layers(cache))
        assert time.monotonic() - began < 0.5 + 2.0  # the deadline, plus a margin for a loaded 2-core machine
        before = [t.clone() for t in target]
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(0.3)  # had a read been left running, the server's reply would land now
    assert _equal(target, before)


def test_holds_run_counts_whole_blocks_from_the_first_in_two_round_trips(server):
    blocks, chain, _ = _setup(server)
    store = blocks.store
    assert store.holds_run([b.key for b in chain]) == 3
    client = _client(server)
    client.delete(_frames(server, chain[2].key)[-1])
    assert store.holds_run([b.key for b in chain]) == 2
    client.set(f"kvrag:{{{chain[1].key}}}:m", b"garbage")
    assert store.holds_run([b.key for b in chain]) == 1
    assert store.holds_run([]) == 0


def test_a_refused_block_says_why_and_loads_again_once_saved_again(server):
    blocks, chain, cache = _setup(server)
    client = _client(server)
    name = _frames(server, chain[0].key)[0]
    raw = bytearray(client.get(name))
    raw[7] ^= 0x40
    client.set(name, bytes(raw))
    with pytest.raises(StateError) as refused:
        blocks.load_into(chain[0], _views(cache, 3), _layers(cache))
    assert refused.value.reason == "integrity" and refused.value.key == chain[0].key
    blocks.save(chain[0], _views(cache, 0))
    blocks.load_into(chain[0], _views(cache, 3), _layers(cache))
    assert _equal(_views(cache, 3), _views(cache, 0))


@pytest.mark.parametrize("damage", ["flipped byte", "no frame table", "a frame gone"])
def test_a_run_lands_the_blocks_before_the_first_bad_one_and_says_why(server, damage, checks):
    blocks, chain, cache = _setup(server)
    client = _client(server)
    frame = _frames(server, chain[1].key)[-1]
    if damage == "flipped byte":
        raw = bytearray(client.get(frame))
        raw[-1] ^= 1
        client.set(frame, bytes(raw))
    elif damage == "no frame table":
        client.delete(f"kvrag:{{{chain[1].key}}}:m")
    else:
        client.delete(frame)
    run = blocks.load_run(chain, [_views(cache, 3 + i) for i in range(3)], _layers(cache))
    assert run.landed == 1 and run.tiers == {blocks.store.url: 1}
    assert run.error is not None and run.error.key == chain[1].key
    assert run.error.reason == ("integrity" if damage == "flipped byte" else "missing")
    assert _equal(_views(cache, 3), _views(cache, 0))
    assert blocks.stats.refused == {run.error.reason: 1}
