"""The artifact codec: round trips without copies, and refuses anything malformed with IntegrityError."""

import json
import struct

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrag import IntegrityError, KVEngine, MemoryStore
from kvrag.artifacts.digests import chunk_digests
from kvrag.artifacts.format import decode_payload, encode_payload, parse_manifest, state_key

from ..conftest import DOC_A, tiny

_ENGINE = KVEngine(tiny("gemma3"), MemoryStore())
_REF = _ENGINE.deposit(DOC_A)
MANIFEST_BYTES = _ENGINE.store.read_manifest(_REF.key)
PAYLOAD = _ENGINE.store.read(_REF.key).payload
MANIFEST = parse_manifest(MANIFEST_BYTES)


def test_round_trip_is_exact_and_zero_copy():
    tensors = decode_payload(PAYLOAD, MANIFEST)
    assert encode_payload(tensors) == PAYLOAD
    buffer = bytearray(PAYLOAD)
    manifest = MANIFEST
    tensors = decode_payload(buffer, manifest)
    base = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    for tensor in tensors.values():
        assert base <= tensor.data_ptr() < base + len(buffer)


def test_payload_keeps_the_cache_dtype():
    engine = KVEngine(tiny("llama", "bfloat16"), MemoryStore())
    ref = engine.deposit(DOC_A)
    manifest = parse_manifest(engine.store.read_manifest(ref.key))
    tensors = decode_payload(engine.store.read(ref.key).payload, manifest)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert {layer.dtype for layer in manifest.layers} == {"BF16"}


def test_state_key_depends_on_everything_it_addresses():
    base = state_key("m" * 64, None, [1, 2, 3])
    assert base == state_key("m" * 64, None, [1, 2, 3])
    assert base != state_key("n" * 64, None, [1, 2, 3])
    assert base != state_key("m" * 64, "a" * 64, [1, 2, 3])
    assert base != state_key("m" * 64, None, [1, 2, 4])
    assert base != state_key("m" * 64, None, [1, 2])


def test_oversized_header_is_refused_before_reading():
    payload = struct.pack("<Q", 1 << 40) + b"{}"
    manifest = _rehashed(MANIFEST, payload)
    try:
        decode_payload(payload, manifest)
    except IntegrityError as e:
        assert "refusing" in str(e)
    else:
        raise AssertionError("an oversized header was accepted")


def _rehashed(manifest, payload):
    import hashlib

    return manifest.model_copy(update={
        "payload_bytes": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "payload_chunks": chunk_digests(payload, manifest.payload_chunk_bytes),
    })


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_random_payload_bytes_only_raise_integrity_errors(data):
    try:
        decode_payload(data, _rehashed(MANIFEST, data))
    except IntegrityError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_payloads_only_raise_integrity_errors(data):
    payload = bytearray(PAYLOAD)
    header_len = struct.unpack("<Q", payload[:8])[0]
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, 8 + header_len + 16))
        payload[index] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    mutated = bytes(payload[:cut] if data.draw(st.booleans()) else payload)
    try:
        tensors = decode_payload(mutated, _rehashed(MANIFEST, mutated))
    except IntegrityError:
        return
    assert set(tensors) == set(decode_payload(PAYLOAD, MANIFEST))  # survived: still well-formed


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=512), st.text(max_size=512)))
def test_random_manifests_only_raise_integrity_errors(data):
    try:
        parse_manifest(data)
    except IntegrityError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(json.loads(MANIFEST_BYTES))), json_values)
def test_manifests_with_a_field_replaced_only_raise_integrity_errors(field, value):
    data = json.loads(MANIFEST_BYTES)
    data[field] = value
    try:
        parse_manifest(json.dumps(data))
    except IntegrityError:
        pass


def test_absurd_sizes_are_refused():
    data = json.loads(MANIFEST_BYTES)
    data["token_count"] = 10**12
    try:
        parse_manifest(json.dumps(data))
    except IntegrityError:
        pass
    else:
        raise AssertionError("an absurd token count was accepted")


def test_chunk_digests_catch_damage_in_any_chunk():
    manifest = MANIFEST.model_copy(update={"payload_chunk_bytes": 1000})
    manifest = _rehashed(manifest, PAYLOAD)
    assert len(manifest.payload_chunks) > 3
    decode_payload(PAYLOAD, manifest)
    for position in (5, 1500, len(PAYLOAD) - 1):
        damaged = bytearray(PAYLOAD)
        damaged[position] ^= 0x80
        try:
            decode_payload(bytes(damaged), manifest)
        except IntegrityError:
            continue
        raise AssertionError(f"damage at {position} went unnoticed")
