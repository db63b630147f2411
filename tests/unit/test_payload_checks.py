"""Per-chunk checks (keyed BLAKE3 tags, AES-256-GCM) and confidential envelopes, on their own."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrag import KVEngine
from kvrag.artifacts.digests import CheckedBuffer, PayloadChunking, open_payload, read_checked
from kvrag.artifacts.format import parse_manifest
from kvrag.artifacts.payloads import AeadChunks, KeyedTags, seal_payload
from kvrag.errors import IntegrityError, SignatureError, StoreError
from kvrag.stores import open_store
from kvrag.trust.confidential import encrypt_manifest, encrypt_record, open_manifest, open_record

from ..conftest import DOC_A, QUESTION, tiny

KEY = b"a-signing-key-for-chunk-checks"
STATE = "ab" * 32
OTHER_STATE = "cd" * 32


def chunking_for(stored, seal, state_key=STATE, key=KEY, chunk=4096) -> PayloadChunking:
    size = len(stored)
    count = -(-size // chunk)
    if seal.scheme == "blake3-keyed/1":
        return PayloadChunking(size, chunk, ("0" * 64,) * count, KeyedTags(key, state_key, tuple(seal.tags)))
    opener = AeadChunks(key, state_key, bytes.fromhex(seal.nonce), count)
    return PayloadChunking(size, chunk, ("0" * 64,) * count, opener, seal.plain_bytes)


def stored_bytes(stored) -> bytes:
    return bytes(stored.view()) if isinstance(stored, CheckedBuffer) else bytes(stored)


@pytest.mark.parametrize("confidential", [False, True])
def test_sealed_payloads_open_to_their_plaintext_and_nothing_else(confidential):
    plain = os.urandom(4096 * 5 + 123)
    stored, seal = seal_payload(plain, KEY, STATE, 4096, confidential=confidential)
    raw = stored_bytes(stored)
    assert (raw == plain) is (not confidential)
    chunking = chunking_for(raw, seal)
    opened = open_payload(raw, chunking)
    assert bytes(opened.view() if isinstance(opened, CheckedBuffer) else opened) == plain
    # read chunk by chunk as a disk tier does
    stream = iter(raw[i : i + 4096] for i in range(0, len(raw), 4096))

    def readinto(view):
        chunk = next(stream)
        view[: len(chunk)] = chunk
        return len(chunk)

    buffer = read_checked(readinto, chunking)
    assert bytes(buffer.view()) == plain and buffer.checked_by == chunking.chunk_opener.identity
    assert open_payload(buffer, chunking) is buffer  # checked once, never again
    for wrong in (chunking_for(raw, seal, state_key=OTHER_STATE), chunking_for(raw, seal, key=b"another key")):
        assert open_payload(raw, wrong) is None
    flipped = bytearray(raw)
    flipped[4096 * 3 + 7] ^= 0x80
    assert open_payload(bytes(flipped), chunking) is None
    assert open_payload(raw[:-1], chunking) is None


def test_a_state_written_now_carries_keyed_tags_and_its_sha256_record():
    engine = KVEngine(tiny("llama"), "memory://", signing_key=KEY)
    ref = engine.deposit(DOC_A)
    manifest = parse_manifest(engine.store.read_manifest(ref.key))
    assert manifest.payload_seal.scheme == "blake3-keyed/1" and len(manifest.payload_seal.tags) == len(manifest.payload_chunks)
    assert len(manifest.payload_sha256) == 64
    assert engine.generate(QUESTION, states=[ref], max_new_tokens=1).receipt.mode == "exact-graft"


def test_confidential_is_opt_in_per_store_url_and_a_bad_flag_is_refused():
    assert open_store("memory://?confidential=1").confidential is True
    assert open_store("memory://").confidential is False
    assert open_store("memory://,memory://?confidential=1").confidential is True
    with pytest.raises(StoreError, match="takes 1 or 0"):
        open_store("memory://?confidential=maybe")
    engine = KVEngine(tiny("llama"), "memory://?confidential=1", signing_key=KEY)
    assert engine.confidential
    ref = engine.deposit(DOC_A)
    raw = engine.store.read_manifest(ref.key)
    assert raw.startswith(b'{"format":"kvrag.private/1"')
    assert set(json.loads(raw)) == {"format", "payload_bytes", "payload_chunk_bytes", "sealed"}
    manifest = parse_manifest(open_manifest(raw, engine.signing_key, ref.key))
    assert manifest.payload_seal.scheme == "aes-256-gcm/1"
    assert engine.generate(QUESTION, states=[ref], max_new_tokens=1).receipt.mode == "exact-graft"


def test_envelopes_open_only_for_their_key_and_slot():
    raw = b'{"signature":null}'
    sealed = encrypt_manifest(raw, KEY, STATE, 10, 10)
    assert open_manifest(sealed, KEY, STATE) == raw
    assert open_manifest(raw, KEY, STATE) == raw  # no envelope: returned for its signature check
    for key, slot in ((b"other", STATE), (KEY, OTHER_STATE)):
        with pytest.raises(SignatureError, match="does not open"):
            open_manifest(sealed, key, slot)
    record = encrypt_record(KEY, "memo/" + STATE, b"the answer")
    assert open_record(KEY, "memo/" + STATE, record) == b"the answer"
    with pytest.raises(SignatureError):
        open_record(KEY, "memo/" + OTHER_STATE, record)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_any_bytes_after_the_envelope_head_are_refused_as_a_signature_error(tail):
    raw = b'{"format":"kvrag.private/1"' + tail
    with pytest.raises(SignatureError):
        open_manifest(raw, KEY, STATE)
    with pytest.raises(SignatureError):
        open_record(KEY, "memo/" + STATE, b"kvrag.private-record/1 " + tail)


@pytest.mark.parametrize("seal", [
    {"scheme": "blake3-keyed/1", "tags": []},
    {"scheme": "blake3-keyed/1", "tags": ["0" * 64], "nonce": "0" * 32},
    {"scheme": "aes-256-gcm/1", "nonce": "0" * 32, "plain_bytes": 10, "plain_chunk_bytes": 10},
    {"scheme": "aes-256-gcm/1", "plain_bytes": 10, "plain_chunk_bytes": 8388592},
    {"scheme": "rot13"},
])
def test_a_manifest_whose_seal_does_not_cover_its_payload_is_malformed(seal):
    engine = KVEngine(tiny("llama"), "memory://", signing_key=KEY)
    manifest = json.loads(engine.store.read_manifest(engine.deposit(DOC_A).key))
    manifest["payload_seal"] = seal
    with pytest.raises(IntegrityError, match="malformed"):
        parse_manifest(json.dumps(manifest))


def test_payloads_lie_in_layer_order_and_read_back_with_safetensors_itself():
    import torch
    from safetensors.torch import load

    from kvrag.artifacts.format import encode_payload

    tensors = {}
    for i in range(12):  # past 10: name order would put layer 10 before layer 2
        for part, dtype in (("keys", torch.bfloat16), ("values", torch.bfloat16)):
            tensors[f"layers.{i}.{part}"] = torch.randn(1, 2, 3 + i, 4).to(dtype)
    raw = encode_payload(dict(reversed(list(tensors.items()))))
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    order = sorted(header, key=lambda name: header[name]["data_offsets"][0])
    assert order == [f"layers.{i}.{part}" for i in range(12) for part in ("keys", "values")]
    assert (8 + header_len) % 8 == 0
    loaded = load(raw)
    assert set(loaded) == set(tensors)
    assert all(torch.equal(loaded[name].view(torch.uint16), tensors[name].view(torch.uint16)) for name in tensors)


def test_looking_after_a_store_of_confidential_states(tmp_path):
    from kvrag.apps.maintenance import collect_garbage, inspect_state, list_states

    url = f"disk://{tmp_path}?confidential=1"
    owner = KVEngine(tiny("llama"), url, signing_key=KEY)
    ref = owner.deposit(DOC_A)
    mine = [info for info in list_states(owner.store, KEY)]
    assert [(i.key, i.encrypted, i.signature, i.tokens) for i in mine] == [(ref.key, True, "valid", ref.token_count)]
    theirs = list(list_states(owner.store, b"somebody else's key"))
    assert [(i.key, i.encrypted, i.signature, i.tokens, i.error) for i in theirs] == [(ref.key, True, "not your key", None, None)]
    found = inspect_state(owner.store, ref.key, KEY)
    entry = next(iter(found.values()))
    assert entry["encrypted"] and entry["signature"] == "valid"
    assert entry["payload"].startswith("ok: every chunk passes its aes-256-gcm/1 check")
    other = next(iter(inspect_state(owner.store, ref.key, b"somebody else's key").values()))
    assert other["signature"] == "not your key" and "manifest" not in other
    report = collect_garbage(owner.store)  # gc under this user's key, which cannot open the state
    assert report.damaged_states == [] and ref.key in list(owner.store.keys())


def test_reads_accept_both_forms_each_authenticated_under_the_readers_key():
    from kvrag.stores import MemoryStore

    store = MemoryStore()
    plain = KVEngine(tiny("llama"), store, signing_key=KEY)
    private = KVEngine(tiny("llama"), store, signing_key=KEY, confidential=True)
    text = plain.generate(QUESTION, states=[DOC_A], max_new_tokens=1, graft=False, memo=False).receipt
    ref = plain.deposit(DOC_A)  # written in the clear: a confidential reader grafts it
    assert private.generate(QUESTION, states=[ref], max_new_tokens=1, memo=False).receipt.mode == "exact-graft"
    store.delete(ref.key)
    private.deposit(DOC_A)  # written encrypted: a reader in the clear with the same key grafts it too
    assert store.read_manifest(ref.key).startswith(b'{"format":"kvrag.private/1"')
    receipt = plain.generate(QUESTION, states=[ref], max_new_tokens=1, memo=False).receipt
    assert receipt.mode == "exact-graft" and receipt.first_token_logits_sha256 == text.first_token_logits_sha256


def test_bytes_held_in_memory_are_checked_once_and_bytes_put_anew_again(monkeypatch):
    """A memory tier keeps a payload immutable: its first read checks every chunk's tag, later reads
    of the same bytes check none; bytes put in its place (a flipped byte) are checked again and
    answered by text."""
    from kvrag import MemoryStore

    opened = []
    real_open = KeyedTags.open
    monkeypatch.setattr(KeyedTags, "open", lambda self, *a: opened.append(a[0]) or real_open(self, *a))
    store = MemoryStore()
    engine = KVEngine(tiny("llama"), store)
    ref = engine.deposit(DOC_A)
    modes = []
    for _ in range(3):
        modes.append(engine.generate(QUESTION, states=[ref], max_new_tokens=1, memo=False).receipt.mode)
        modes.append(len(opened))
    assert modes == ["exact-graft", 1, "exact-graft", 1, "exact-graft", 1]
    manifest, payload = store.read(ref.key).manifest, bytearray(store.read(ref.key).payload)
    payload[len(payload) // 2] ^= 1
    store.put(ref.key, manifest, bytes(payload))
    assert engine.generate(QUESTION, states=[ref], max_new_tokens=1, memo=False).receipt.mode == "text-prefill"
    assert len(opened) == 2


def test_a_check_under_one_key_is_never_taken_for_a_check_under_another():
    tags = ("00" * 32,)
    assert KeyedTags(KEY, STATE, tags).identity == KeyedTags(KEY, STATE, tags).identity
    assert KeyedTags(KEY, STATE, tags).identity != KeyedTags(b"another-key" * 3, STATE, tags).identity
    nonce = b"n" * 12
    assert AeadChunks(KEY, STATE, nonce, 1).identity != AeadChunks(b"another-key" * 3, STATE, nonce, 1).identity
