"""Paged engines' blocks in kvrag stores: a block round-trips bit for bit; a flipped byte, an edited
or re-signed manifest, a block moved to another key, another engine's block and another tenant's
block are each refused with their reason, and counted."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrag.errors import ForeignStateError, IntegrityError, SignatureError, StateError, StateNotFoundError
from kvrag.paged import BlockEngine, BlockStore
from kvrag.paged.blocks import parse_block_manifest
from kvrag.stores import open_store
from kvrag.trust.signing import sign_manifest_bytes

KEY = b"k" * 32
ENGINE = BlockEngine({"vllm": "0.32.0", "model": "m", "dtype": "float32", "block_size": "4", "layout": "KBHNC"})


def _tensors(seed: int, dtype: torch.dtype = torch.float32, layers: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, 2, 8, generator=gen).to(dtype) for _ in range(layers)]


@pytest.fixture(params=["memory", "disk"])
def store(request, tmp_path):
    url = "memory://" if request.param == "memory" else f"disk://{tmp_path}"
    opened = open_store(url)
    yield opened
    opened.close()


def test_a_chain_of_blocks_round_trips_bit_for_bit(store):
    blocks = BlockStore(store, ENGINE, KEY)
    chain = blocks.chain(list(range(10)), 4)
    assert [b.start for b in chain] == [0, 4]  # full blocks only
    assert chain[1].parent_key == chain[0].key
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        kept = {}
        for index, block in enumerate(chain):
            kept[block.key] = _tensors(index, dtype)
            blocks.save(block, kept[block.key])
        assert blocks.held(chain) == 2
        for block in chain:
            loaded = blocks.load(block)
            for got, want in zip(loaded.tensors, kept[block.key]):
                assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert blocks.stats.saved == 6 and sum(blocks.stats.loaded.values()) == 6 and not blocks.stats.refused


def test_keys_depend_on_the_chain_the_engine_and_the_tenant(store):
    ids = list(range(8))
    one = BlockStore(store, ENGINE, KEY).chain(ids, 4)
    assert BlockStore(store, ENGINE, KEY).chain(ids, 4) == one
    assert BlockStore(store, ENGINE, KEY).chain([9] + ids[1:], 4)[1].key != one[1].key  # other parent
    assert BlockStore(store, BlockEngine({**ENGINE.settings, "dtype": "bfloat16"}), KEY).chain(ids, 4)[0].key != one[0].key
    assert BlockStore(store, ENGINE, KEY, namespace="a").chain(ids, 4)[0].key != one[0].key
    assert BlockStore(store, ENGINE, b"x" * 32).chain(ids, 4)[0].key != one[0].key


def test_held_stops_at_the_first_missing_block(store):
    blocks = BlockStore(store, ENGINE, KEY)
    chain = blocks.chain(list(range(12)), 4)
    blocks.save(chain[0], _tensors(0))
    blocks.save(chain[2], _tensors(2))
    assert blocks.held(chain) == 1
    with pytest.raises(StateNotFoundError):
        blocks.load(chain[1])
    assert blocks.stats.refused == {"missing": 1}


def _flip(store, key: str, at: int) -> None:
    raw = store.read(key)
    payload = bytearray(bytes(memoryview(raw.payload).cast("B")))
    payload[at] ^= 1
    store.put(key, raw.manifest, bytes(payload))


def test_a_flipped_payload_byte_is_refused_as_integrity(store):
    blocks = BlockStore(store, ENGINE, KEY)
    block = blocks.chain(list(range(4)), 4)[0]
    blocks.save(block, _tensors(0))
    _flip(store, block.key, 77)
    with pytest.raises(IntegrityError) as refused:
        blocks.load(block)
    assert refused.value.reason == "integrity"
    assert blocks.stats.refused == {"integrity": 1}


def test_an_edited_or_foreign_signed_manifest_is_refused_as_signature(store):
    blocks = BlockStore(store, ENGINE, KEY)
    block = blocks.chain(list(range(4)), 4)[0]
    blocks.save(block, _tensors(0))
    raw = store.read(block.key)
    edited = raw.manifest.replace(b'"start":0', b'"start":4')
    store.put(block.key, edited, bytes(memoryview(raw.payload).cast("B")))
    with pytest.raises(SignatureError):
        blocks.load(block)
    other = json.loads(raw.manifest)
    other["signature"] = None
    store.put(block.key, sign_manifest_bytes(json.dumps(other).encode(), b"y" * 32), bytes(memoryview(raw.payload).cast("B")))
    with pytest.raises(SignatureError):
        blocks.load(block)
    assert blocks.stats.refused == {"signature": 2}


def test_a_block_moved_to_another_key_is_refused(store):
    blocks = BlockStore(store, ENGINE, KEY)
    first, second = blocks.chain(list(range(8)), 4)
    blocks.save(first, _tensors(0))
    raw = store.read(first.key)
    store.put(second.key, raw.manifest, bytes(memoryview(raw.payload).cast("B")))
    with pytest.raises(IntegrityError):
        blocks.load(second)


def test_another_engines_block_is_foreign_and_says_what_differs(store):
    writer = BlockStore(store, ENGINE, KEY)
    block = writer.chain(list(range(4)), 4)[0]
    writer.save(block, _tensors(0))
    other = BlockEngine({**ENGINE.settings, "block_size": "8"})
    reader = BlockStore(store, other, KEY)
    reader._scope = writer._scope  # the same address, another engine: only the manifest can tell
    with pytest.raises(ForeignStateError, match="block_size"):
        reader.load(block)
    assert reader.stats.refused == {"foreign": 1}


def test_a_block_of_another_layout_is_foreign(store):
    blocks = BlockStore(store, ENGINE, KEY)
    block = blocks.chain(list(range(4)), 4)[0]
    blocks.save(block, _tensors(0))
    wanted = parse_block_manifest(store.read(block.key).manifest).layers
    assert blocks.load(block, wanted).tensors
    with pytest.raises(ForeignStateError):
        blocks.load(block, wanted[:2])


def test_one_tenant_never_loads_anothers_blocks(store):
    a = BlockStore(store, ENGINE, KEY, namespace="a")
    b = BlockStore(store, ENGINE, KEY, namespace="b")
    ids = list(range(8))
    for block in a.chain(ids, 4):
        a.save(block, _tensors(block.start))
    assert a.held(a.chain(ids, 4)) == 2
    assert b.held(b.chain(ids, 4)) == 0
    # even pointed at a's very keys, b's key refuses a's signatures
    with pytest.raises(SignatureError):
        b.load(a.chain(ids, 4)[0])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400) | st.builds(lambda d: json.dumps(d).encode(), st.dictionaries(st.text(max_size=12), st.integers() | st.text(max_size=8), max_size=8)))
def test_any_manifest_bytes_parse_or_raise_integrity(raw):
    try:
        parse_block_manifest(raw)
    except IntegrityError:
        pass


def test_a_manifest_claiming_more_than_its_payload_is_refused_before_allocation():
    blocks = BlockStore(open_store("memory://"), ENGINE, KEY)
    block = blocks.chain(list(range(4)), 4)[0]
    blocks.save(block, _tensors(0))
    manifest = json.loads(blocks.store.read(block.key).manifest)
    manifest["layers"][0]["shape"] = [1 << 20, 1 << 20]
    with pytest.raises(IntegrityError, match="malformed"):
        parse_block_manifest(json.dumps(manifest).encode())


def test_a_spent_deadline_refuses_the_read_as_unavailable(store):
    from kvrag.stores import Deadline

    blocks = BlockStore(store, ENGINE, KEY, deadline_s=30)
    block = blocks.chain(list(range(4)), 4)[0]
    blocks.save(block, _tensors(0))
    spent = Deadline(0)
    with pytest.raises(StateError) as refused:
        blocks.load(block, deadline=spent)
    assert refused.value.reason == "unavailable" and blocks.stats.refused == {"unavailable": 1}
    assert blocks.held([block], spent) == 0
    assert blocks.load(block).tensors  # a request of its own has its own budget


def test_load_into_writes_the_checked_block_into_the_callers_tensors(store):
    blocks = BlockStore(store, ENGINE, KEY)
    block = blocks.chain(list(range(4)), 4)[0]
    saved = _tensors(3)
    blocks.save(block, saved)
    targets = [torch.zeros_like(t) for t in saved]
    assert blocks.load_into(block, targets) == store.url
    assert all(torch.equal(a, b) for a, b in zip(targets, saved))
    with pytest.raises(ValueError):
        blocks.load_into(block, targets[:2])
    payload = store.read(block.key)
    assert payload is not None
    raw = bytearray(memoryview(payload.payload).cast("B"))
    raw[5] ^= 1
    store.put(block.key, payload.manifest, bytes(raw))
    untouched = [torch.full_like(t, 7.0) for t in saved]
    with pytest.raises(IntegrityError):
        blocks.load_into(block, untouched)
    assert all(bool((t == 7.0).all()) for t in untouched)  # checked before a byte is copied
