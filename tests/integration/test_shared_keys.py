"""Two machines on one Redis, each with the signing key it generated: the trap is named, not silent.

Each "machine" is its own `KVRAG_HOME` (where the key is generated on first use). Deposits on A are
invisible to B; B warns at start-up, and its receipt and `kvrag explain` say the text was stored
under another signing key or namespace. What they say must not reveal anything a reader without
A's key could not already learn: no key, key id, namespace, state key or model of A's."""

from __future__ import annotations

import json
import logging
import re

import pytest
from typer.testing import CliRunner

from kvrag import KVEngine
from kvrag.cli import app
from kvrag.trust import signing

from ..conftest import DOC_A, tiny

QUESTION = "Who built it?"


@pytest.fixture
def machines(tmp_path, monkeypatch):
    """Switch between two machines' homes; no shared key in the environment."""
    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    monkeypatch.delenv(signing.KEY_FILE_ENV, raising=False)
    signing._warned.clear()  # each machine warns once in its own process

    def use(name: str) -> None:
        monkeypatch.setenv("KVRAG_HOME", str(tmp_path / name))
        signing._warned.clear()

    return use


def test_separately_generated_keys_on_one_redis_warn_and_name_the_cause(redis_server, machines, caplog, tmp_path):
    model = tiny("llama")
    machines("a")
    elsewhere = "redis://:hunter2@redis.fleet.internal:6379/0"  # another host: made without a connection
    with caplog.at_level(logging.WARNING, logger="kvrag"):
        KVEngine(model, elsewhere)
    assert "generated on this machine" in caplog.text and "redis://redis.fleet.internal:6379/0" in caplog.text
    assert "--signing-key-file" in caplog.text and "hunter2" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvrag"):
        a = KVEngine(model, redis_server.url)  # a Redis on loopback serves this machine only
    assert "generated on this machine" not in caplog.text
    ref = a.deposit(DOC_A)
    a_key = signing.default_key_path().read_bytes().strip()

    machines("b")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvrag"):
        KVEngine(model, elsewhere)
    assert "will neither see nor graft" in caplog.text
    b = KVEngine(model, redis_server.url)
    answer = b.generate(QUESTION, states=[DOC_A], max_new_tokens=2, deposit_missing=False)
    (use,) = answer.receipt.states
    assert answer.receipt.mode == "text-prefill" and use.reason == "missing"
    assert "stored under another signing key or namespace" in use.detail

    doc = tmp_path / "doc.txt"
    doc.write_text(DOC_A)
    explained = CliRunner().invoke(app, ["explain", "--doc", str(doc), "--model", "tiny-random-llama",
                                         "--store", redis_server.url, "--json"])
    assert explained.exit_code == 0, explained.output
    (row,) = json.loads(explained.stdout)["documents"]
    assert row["verdict"] == "reads text" and row["other_keys"] == 1 and row["elsewhere"] == []
    shown = CliRunner().invoke(app, ["explain", "--doc", str(doc), "--model", "tiny-random-llama",
                                     "--store", redis_server.url]).stdout
    assert "stored under another signing key or namespace" in shown

    # Nothing of A's is revealed: not its key, not its state key, not its scope.
    said = use.detail + explained.stdout + shown
    for secret in (a_key.decode(), ref.key, ref.key[:12], a.identity.scope, a.identity.scope_id):
        assert secret not in said
    # The unsigned hint holds only marks: 32 hex characters each, none of them A's key or scope.
    import redis

    client = redis.Redis.from_url(redis_server.url)
    hints = [k for k in client.scan_iter(match="*seen/*")]
    assert len(hints) == 1
    marks = json.loads(client.get(hints[0]))
    assert len(marks) == 1 and re.fullmatch(r"[0-9a-f]{32}", marks[0])
    assert marks[0] not in (a_key.decode(), a.identity.scope, a.identity.scope_id)


def test_a_shared_key_grafts_and_warns_about_nothing(redis_server, machines, caplog, tmp_path, monkeypatch):
    key_file = tmp_path / "shared.key"
    key_file.write_text("a shared secret of the fleet, 32 bytes or more\n")
    model = tiny("llama")
    machines("a")
    a = KVEngine(model, redis_server.url, signing_key=key_file.read_bytes().strip())
    a.deposit(DOC_A)
    machines("b")
    monkeypatch.setenv(signing.KEY_FILE_ENV, str(key_file))
    with caplog.at_level(logging.WARNING, logger="kvrag"):
        b = KVEngine(model, redis_server.url)
    assert "generated on this machine" not in caplog.text
    assert b.generate(QUESTION, states=[DOC_A], max_new_tokens=2).receipt.mode == "exact-graft"


def test_a_key_copied_from_another_host_does_not_warn_and_local_stores_never_do(machines, caplog, tmp_path):
    machines("c")
    signing.resolve_signing_key()  # generated here
    with caplog.at_level(logging.WARNING, logger="kvrag"):
        KVEngine(tiny("llama"), f"disk://{tmp_path / 'states'}")
        KVEngine(tiny("llama"), "memory://")
    assert "generated on this machine" not in caplog.text
    for loopback in ("redis://127.0.0.1:1/0", "redis://localhost:6379", "rediss://[::1]:6380/0",
                     "redis+cluster://127.0.0.1:7000,127.0.0.2:7001"):
        assert signing.warn_if_unshared(None, [loopback]) is None
    assert signing.warn_if_unshared(None, ["redis+cluster://127.0.0.1:7000,10.0.0.2:7001"]) is not None
    (tmp_path / "c" / "signing.key.origin").write_text("another-host\n")
    assert signing.warn_if_unshared(None, ["redis://10.0.0.2:1/0"]) is None


def test_naming_this_machines_own_key_file_silences_the_warning(machines, monkeypatch):
    machines("d")
    signing.resolve_signing_key()  # generated here
    assert signing.warn_if_unshared(None, ["redis://10.0.0.2:6379/0"]) is not None
    signing._warned.clear()
    monkeypatch.setenv(signing.KEY_FILE_ENV, str(signing.default_key_path()))
    assert signing.warn_if_unshared(None, ["redis://10.0.0.2:6379/0"]) is None


def test_a_forged_or_oversized_hint_changes_only_the_sentence(redis_server, machines):
    """The hint is unsigned: a writer can forge it, but it steers no answer, and junk is no hint."""
    import redis

    from kvrag.core.whereabouts import Whereabouts

    machines("d")
    engine = KVEngine(tiny("llama"), redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    text_answer = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=2, deposit_missing=False)
    slot = Whereabouts.hint_slot(DOC_A)
    for junk in (b"x" * 10_000, b"[[[[[[[[", b'{"a": 1}', json.dumps(["zz" * 16]).encode()):
        engine.store.put_blob(slot, junk)
        assert engine.whereabouts.other_keys(engine.plan([DOC_A])[0]) == 0
    engine.store.put_blob(slot, json.dumps(["ab" * 16]).encode())  # a forged mark
    forged = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=2, deposit_missing=False)
    assert "another signing key" in forged.receipt.states[0].detail
    assert forged.receipt.first_token_logits_sha256 == text_answer.receipt.first_token_logits_sha256
    assert forged.text == text_answer.text
    client.close()
