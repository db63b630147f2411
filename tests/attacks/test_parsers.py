"""Stored bytes built to crash a parser: each is an integrity miss, and the text answers.

The manifests here are signed with the victim's key (an insider, or a bug in a writer), so the
bytes reach the parsers behind the signature check."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

from kvrag.artifacts.digests import chunk_digests

from ..conftest import DOC_A, QUESTION, resigned
from .conftest import engine, text_logits


def _with_payload(victim, ref, payload: bytes) -> None:
    data = json.loads(victim.store.read_manifest(ref.key))
    data.update(payload_bytes=len(payload), payload_sha256=hashlib.sha256(payload).hexdigest(),
                payload_chunks=chunk_digests(payload, data["payload_chunk_bytes"]))
    victim.store.put(ref.key, resigned(victim, data), payload)


def _header(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header


PAYLOADS = {
    "header nested 200,000 deep": _header(b"[" * 200_000 + b"]" * 200_000),
    "header with huge shapes": _header(json.dumps({"layers.0.keys": {"dtype": "F32", "shape": [2**62, 2**62],
                                                                      "data_offsets": [0, 2**63]}}).encode()),
    "header claiming 2**64 bytes": struct.pack("<Q", 2**64 - 1) + b"{}",
    "header that is not UTF-8": _header(b"\xff\xfe\xfd"),
    "empty payload": b"",
}


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_a_hostile_payload_is_an_integrity_miss(server, kind):
    victim = engine(server.url)
    ref = victim.deposit(DOC_A)
    _with_payload(victim, ref, PAYLOADS[kind])
    answer = victim.generate(QUESTION, states=[ref], max_new_tokens=1)
    assert answer.receipt.mode == "text-prefill" and answer.receipt.states[0].reason == "integrity"
    assert answer.receipt.first_token_logits_sha256 == text_logits()


MANIFEST_EDITS = {
    "token id 2**64": lambda d: d["token_ids"].__setitem__(0, 2**64),
    "token id past the vocabulary": lambda d: d["token_ids"].__setitem__(0, 10**6),
    "negative token id": lambda d: d["token_ids"].__setitem__(0, -1),
    "canary id 2**64": lambda d: d["deposit"]["canary_token_ids"].__setitem__(0, 2**64),
    "start 2**64": lambda d: d.__setitem__("start", 2**64),
    "a layer of 2**40 positions": lambda d: d["layers"][0].update(length=2**40, key_shape=[1, 2, 2**40, 16]),
}


@pytest.mark.parametrize("edit", sorted(MANIFEST_EDITS))
def test_a_hostile_manifest_is_an_integrity_miss(server, edit):
    victim = engine(server.url)
    ref = victim.deposit(DOC_A)
    genuine = victim.store.read(ref.key)
    data = json.loads(genuine.manifest)
    MANIFEST_EDITS[edit](data)
    victim.store.put(ref.key, json.dumps(data).encode(), genuine.payload)  # unsigned: refused at the signature
    assert victim.generate(QUESTION, states=[ref], max_new_tokens=1).receipt.states[0].reason == "signature"
    # signed by an insider (the key signs any bytes, parsed or not): the parser itself must refuse it
    victim.store.put(ref.key, resigned(victim, data), genuine.payload)
    answer = victim.generate(QUESTION, states=[ref], max_new_tokens=1)
    assert answer.receipt.mode == "text-prefill" and answer.receipt.states[0].reason == "integrity"
    assert answer.receipt.first_token_logits_sha256 == text_logits()
