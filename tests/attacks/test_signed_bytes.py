"""A manifest's signature covers the bytes that are stored, checked before they are parsed: another
encoding of the same manifest, signed as stored, grafts; any other byte, or a second signature
field, is refused (and the text answers)."""

from __future__ import annotations

import json

import pytest

from kvrag.errors import SignatureError
from kvrag.trust.signing import check_manifest_bytes, sign_manifest_bytes

from ..conftest import DOC_A, QUESTION
from .conftest import engine, text_logits


def _reencoded(raw: bytes) -> bytes:
    """The same manifest as another JSON encoder would write it: indented, keys in reverse order,
    unsigned (what a pydantic upgrade that changed its output would store)."""
    fields = json.loads(raw)
    fields["signature"] = None
    return json.dumps(dict(reversed(list(fields.items()))), indent=1).encode()


def test_another_encoding_signed_as_stored_is_accepted_and_a_changed_byte_refused(server):
    victim = engine(server.url)
    ref = victim.deposit(DOC_A)
    genuine = victim.store.read(ref.key)
    signed = sign_manifest_bytes(_reencoded(genuine.manifest), victim.signing_key)
    assert signed != genuine.manifest and b"\n" in signed
    victim.store.put(ref.key, signed, genuine.payload)
    answer = victim.generate(QUESTION, states=[ref], max_new_tokens=1)
    assert answer.receipt.mode == "exact-graft"

    # One byte of whitespace more, anywhere the signature does not sit: not the bytes signed.
    tampered = signed.replace(b'\n "start"', b'\n  "start"', 1)
    assert tampered != signed
    victim.store.put(ref.key, tampered, genuine.payload)
    answer = victim.generate(QUESTION, states=[ref], max_new_tokens=1)
    assert answer.receipt.mode == "text-prefill" and answer.receipt.states[0].reason == "signature"
    assert answer.receipt.first_token_logits_sha256 == text_logits()


def test_the_manifest_as_deposited_still_verifies_byte_for_byte(server):
    victim = engine(server.url)
    ref = victim.deposit(DOC_A)
    raw = victim.store.read_manifest(ref.key)
    assert check_manifest_bytes(raw, victim.signing_key) == json.loads(raw)["signature"]


@pytest.mark.parametrize("edit", ["second signature field", "signature of other bytes", "unsigned"])
def test_signature_fields_that_do_not_check_out_are_refused_before_parsing(server, edit):
    victim = engine(server.url)
    ref = victim.deposit(DOC_A)
    genuine = victim.store.read(ref.key)
    raw = genuine.manifest
    signature = json.loads(raw)["signature"]
    if edit == "second signature field":
        forged = raw[:-1] + f',"signature":"{signature}"}}'.encode()
    elif edit == "signature of other bytes":
        other = victim.store.read(victim.deposit("Another document entirely.").key).manifest
        forged = raw.replace(signature.encode(), json.loads(other)["signature"].encode())
    else:
        forged = raw.replace(f'"{signature}"'.encode(), b"null")
    with pytest.raises(SignatureError):
        check_manifest_bytes(forged, victim.signing_key)
    victim.store.put(ref.key, forged, genuine.payload)
    answer = victim.generate(QUESTION, states=[ref], max_new_tokens=1)
    assert answer.receipt.mode == "text-prefill" and answer.receipt.states[0].reason == "signature"
