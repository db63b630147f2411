"""Signing is the default: unsigned or foreign-signed states never graft unless the reader opts in."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from kvrag import InputError, KVEngine, MemoryStore
from kvrag.artifacts.format import parse_manifest
from kvrag.trust.signing import default_key_path, sign_manifest

from ..conftest import DOC_A, QUESTION, tiny
from .conftest import engine, text_logits


def _planted(victim, ref, signature):
    genuine = victim.store.read(ref.key)
    manifest = parse_manifest(genuine.manifest)
    forged = manifest.model_copy(update={"signature": None})
    if signature == "another key":
        forged = sign_manifest(forged, b"attacker")
    victim.store.put(ref.key, forged.to_json_bytes(), genuine.payload)
    return genuine


@pytest.mark.parametrize("signature", ["none", "another key"])
def test_a_self_consistent_forged_state_is_refused_by_default(server, signature, caplog):
    victim = engine(server.url)
    ref = victim.deposit(DOC_A)
    _planted(victim, ref, signature)
    with caplog.at_level(logging.WARNING, logger="kvrag.signing"):
        answer = victim.generate(QUESTION, states=[ref], max_new_tokens=1)
    assert answer.receipt.mode == "text-prefill" and answer.receipt.states[0].reason == "signature"
    assert answer.receipt.first_token_logits_sha256 == text_logits()
    assert "refused" in caplog.text


def test_unsigned_states_graft_only_with_an_explicit_opt_in_that_warns_once(server, caplog, monkeypatch):
    from kvrag.trust import signing

    monkeypatch.setattr(signing, "_warned", set())  # this process has warned about no store yet
    victim = engine(server.url)
    ref = victim.deposit(DOC_A)
    _planted(victim, ref, "none")
    opted = [engine(server.url, allow_unsigned=True), engine(server.url + "?allow_unsigned=1")]
    with caplog.at_level(logging.WARNING, logger="kvrag.signing"):
        for opted_in in opted:
            for _ in range(3):
                assert opted_in.generate(QUESTION, states=[ref], max_new_tokens=1).receipt.mode == "exact-graft"
    # once per store, however many reads: both engines open the same Redis
    assert {e.store.url for e in opted} == {server.url}
    assert caplog.text.count("reading unsigned data") == 1
    _planted(victim, ref, "another key")  # a wrong signature is never accepted, opt-in or not
    assert engine(server.url, allow_unsigned=True).generate(QUESTION, states=[ref], max_new_tokens=1).receipt.mode == "text-prefill"


def test_an_empty_key_is_an_error_never_no_signing(monkeypatch):
    monkeypatch.setenv("KVRAG_SIGNING_KEY", "")
    with pytest.raises(InputError, match="empty"):
        KVEngine(tiny("llama"), MemoryStore())
    monkeypatch.delenv("KVRAG_SIGNING_KEY")
    for empty in ("", b"", "   "):
        with pytest.raises(InputError, match="empty"):
            KVEngine(tiny("llama"), MemoryStore(), signing_key=empty)


def test_the_default_key_is_per_user_and_private(tmp_path, monkeypatch):
    monkeypatch.delenv("KVRAG_SIGNING_KEY", raising=False)
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    first = KVEngine(tiny("llama"), MemoryStore()).signing_key
    assert KVEngine(tiny("llama"), MemoryStore()).signing_key == first and len(first) == 64
    mode = stat.S_IMODE(os.stat(default_key_path()).st_mode)
    assert mode == 0o600 and default_key_path().parent == tmp_path


def test_ls_and_inspect_report_a_signature_as_checked_not_as_present(server):
    from kvrag.apps.maintenance import inspect_state, list_states

    victim = engine(server.url)
    own, planted, foreign = (victim.deposit(text) for text in (DOC_A, "A second text.", "A third text."))
    _planted(victim, planted, "none")
    _planted(victim, foreign, "another key")  # a signature is present, and it is not ours
    verdicts = {i.key: i.signature for i in list_states(victim.store, victim.signing_key)}
    assert verdicts == {own.key: "valid", planted.key: "unsigned", foreign.key: "not your key"}
    assert [e["signature"] for e in inspect_state(victim.store, foreign.key, victim.signing_key).values()] == \
        ["not your key"]
    assert all("but the signature is not your key" in e["payload"]
               for e in inspect_state(victim.store, foreign.key, victim.signing_key).values())
