"""The per-read check of every stored chunk (a keyed BLAKE3 tag, or the AES-GCM tag of a confidential
state) against someone who can rewrite a store's bytes: a flipped byte in any chunk, a chunk moved
to another index or copied from another state, another tenant's ciphertext. Each is a miss,
answered by the text with the text's logits, never a wrong graft; on the disk tier, the Redis tier
(frames rewritten on the server) and the memory tier, plain and confidential, with the graft
streamed (its forward running while the chunks arrive) and not."""

from __future__ import annotations

import pytest
import redis

from kvrag import KVEngine
from kvrag.artifacts.digests import CheckedBuffer
from kvrag.artifacts.format import parse_manifest
from kvrag.errors import SignatureError
from kvrag.stores import DiskStore, MemoryStore, RedisStore
from kvrag.trust import derive_tenant_key
from kvrag.trust.confidential import open_manifest

from ..conftest import DOC_A, DOC_B, QUESTION, tiny
from .conftest import DEADLINE_S, text_logits

CHUNK = 16 << 10  # small chunks: a tiny model's state (225 KiB) spans 15 of them
OPERATOR = b"an-operator-key-for-chunk-attacks"
KEY_A, KEY_B = derive_tenant_key(OPERATOR, "tenant-a"), derive_tenant_key(OPERATOR, "tenant-b")


def make_engine(kind: str, where, confidential: bool, key: bytes = KEY_A, stream: bool = True) -> KVEngine:
    if kind == "redis":
        store = f"{where.url}?frame_mib={CHUNK / 2**20}"
    elif kind == "disk":
        store = DiskStore(where / "states")
        store.chunk_bytes = CHUNK
    else:
        store = where
        store.chunk_bytes = CHUNK
    return KVEngine(tiny("llama"), store, signing_key=key, deadline_s=DEADLINE_S, confidential=confidential,
                    stream_grafts=stream)


@pytest.fixture(params=["disk", "redis", "memory"])
def tier(request, tmp_path):
    if request.param == "redis":
        server = request.getfixturevalue("server")
        yield "redis", server
    elif request.param == "disk":
        yield "disk", tmp_path
    else:
        yield "memory", MemoryStore()


def stored_chunks(engine: KVEngine, key: str) -> tuple[bytes, list[bytes]]:
    """The manifest and the stored chunks of `key` as the store holds them (ciphertext if sealed)."""
    stored = engine.store.read(key)  # no check: the bytes as stored
    manifest = stored.manifest
    payload = stored.payload
    raw = bytes(payload.view()) if isinstance(payload, CheckedBuffer) else bytes(payload)
    return manifest, [raw[i : i + CHUNK] for i in range(0, len(raw), CHUNK)]


def rewrite(engine: KVEngine, key: str, chunks: list[bytes]) -> None:
    """The stored chunks of `key` replaced, its manifest untouched: on Redis the frames are SET on
    the server (the frame table stays as written), elsewhere the state is written back whole."""
    store = engine.store
    if isinstance(store, RedisStore):
        frame_table = store.get_frame_table(key)
        client = redis.Redis.from_url(store.url.split("?")[0])
        for index, chunk in enumerate(chunks):
            client.set(f"{store.prefix}:{{{key}}}:f:{frame_table.payload_id}:{index}", chunk)
        client.close()
    else:
        manifest, _ = stored_chunks(engine, key)
        store.put(key, manifest, b"".join(chunks))


def assert_text_answer(engine: KVEngine, reason: str = "integrity") -> None:
    receipt = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=1, memo=False).receipt
    assert receipt.mode == "text-prefill"
    assert receipt.states[0].reason == reason
    assert receipt.first_token_logits_sha256 == text_logits()


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unstreamed"])
@pytest.mark.parametrize("confidential", [False, True], ids=["tagged", "encrypted"])
def test_a_flipped_byte_in_any_chunk_is_a_miss(tier, confidential, stream):
    kind, where = tier
    engine = make_engine(kind, where, confidential, stream=stream)
    ref = engine.deposit(DOC_A)
    _, chunks = stored_chunks(engine, ref.key)
    assert len(chunks) >= 8
    scheme = parse_manifest(open_manifest(engine.store.read_manifest(ref.key), KEY_A, ref.key)).payload_seal.scheme
    assert scheme == ("aes-256-gcm/1" if confidential else "blake3-keyed/1")
    for index in (0, len(chunks) // 2, len(chunks) - 1):
        for offset in (0, len(chunks[index]) // 3, len(chunks[index]) - 1):  # the AEAD tag is the last bytes
            bad = list(chunks)
            flipped = bytearray(bad[index])
            flipped[offset] ^= 0x01
            bad[index] = bytes(flipped)
            rewrite(engine, ref.key, bad)
            assert_text_answer(engine)
    rewrite(engine, ref.key, chunks)
    assert engine.generate(QUESTION, states=[ref], max_new_tokens=1, memo=False).receipt.mode == "exact-graft"


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unstreamed"])
@pytest.mark.parametrize("confidential", [False, True], ids=["tagged", "encrypted"])
def test_a_chunk_moved_to_another_index_or_from_another_state_is_a_miss(tier, confidential, stream):
    kind, where = tier
    engine = make_engine(kind, where, confidential, stream=stream)
    ref, other = engine.deposit(DOC_A), engine.deposit(DOC_B)
    _, chunks = stored_chunks(engine, ref.key)
    _, others = stored_chunks(engine, other.key)
    swapped = list(chunks)
    swapped[1], swapped[2] = chunks[2], chunks[1]
    rewrite(engine, ref.key, swapped)
    assert_text_answer(engine)
    copied = list(chunks)
    copied[1] = others[1]  # the same index of another state, same length
    assert len(others[1]) == len(chunks[1])
    rewrite(engine, ref.key, copied)
    assert_text_answer(engine)


def test_another_tenants_ciphertext_is_a_miss_and_never_opens(tier):
    kind, where = tier
    a = make_engine(kind, where, True, KEY_A)
    b = make_engine(kind, where, True, KEY_B)
    ref_a, ref_b = a.deposit(DOC_A), b.deposit(DOC_A)
    manifest_a, chunks_a = stored_chunks(a, ref_a.key)
    _, chunks_b = stored_chunks(b, ref_b.key)
    assert len(chunks_a) == len(chunks_b)
    with pytest.raises(SignatureError, match="does not open with this key"):
        open_manifest(manifest_a, KEY_B, ref_b.key)
    with pytest.raises(SignatureError, match="does not open with this key"):
        open_manifest(manifest_a, KEY_B, ref_a.key)  # even named by its own key
    rewrite(b, ref_b.key, chunks_a)  # tenant A's ciphertext under tenant B's signed manifest
    assert_text_answer(b, "integrity")
    # tenant A's whole state (envelope and ciphertext) planted under tenant B's key for the same text
    b.store.put(ref_b.key, manifest_a, b"".join(chunks_a))
    assert_text_answer(b, "signature")


def test_a_confidential_store_shows_sizes_only(tier):
    kind, where = tier
    engine = make_engine(kind, where, True)
    ref = engine.deposit(DOC_A)
    engine.generate(QUESTION, states=[ref], max_new_tokens=2)  # a memo entry and whereabouts are written too
    manifest, chunks = stored_chunks(engine, ref.key)
    token_ids = parse_manifest(open_manifest(manifest, KEY_A, ref.key)).token_ids
    needles = [DOC_A[:24].encode(), ",".join(map(str, token_ids[:6])).encode(), b"layers.0.keys", b"model_fingerprint",
               b"tiny-random-llama"]
    stored = manifest + b"".join(chunks)
    for needle in needles:
        assert needle not in stored
    store = engine.store
    blobs = [store.get_blob(name) for prefix in ("memo", "where") for name in store.blob_names(prefix)]
    assert blobs and all(blob.startswith(b"kvrag.private-record/1 ") for blob in blobs)
    for blob in blobs:
        assert DOC_A[:24].encode() not in blob and b"answer" not in blob
    # an engine with another tenant's key reads none of it: it answers from the text
    other = make_engine(kind, where, True, KEY_B)
    receipt = other.generate(QUESTION, states=[DOC_A], max_new_tokens=1, memo=True).receipt
    assert receipt.mode == "text-prefill" and receipt.first_token_logits_sha256 == text_logits()
