"""Tenants are a cryptographic boundary, not a name: each tenant's key is derived from the operator's,
and with it a tenant can neither address, read nor forge another tenant's states or memo entries,
whatever namespace it names. Against a real Redis both tenants share."""

from __future__ import annotations

import pytest

from kvrag import InputError, KVEngine, Provenance
from kvrag.artifacts.format import state_key
from kvrag.trust import derive_tenant_key, tenant_of

from ..conftest import DOC_A, QUESTION, resigned, tiny
from .conftest import DEADLINE_S, text_logits

OPERATOR = b"the-operators-shared-secret"
KEY_A, KEY_B = derive_tenant_key(OPERATOR, "tenant-a"), derive_tenant_key(OPERATOR, "tenant-b")


def tenant(url: str, key: bytes, **kwargs) -> KVEngine:
    return KVEngine(tiny("llama"), url, signing_key=key, deadline_s=DEADLINE_S, **kwargs)


def test_tenant_keys_are_derived_bound_to_their_name_and_cannot_derive_others():
    assert tenant_of(KEY_A) == "tenant-a" and tenant_of(OPERATOR) is None
    assert KEY_A != KEY_B and derive_tenant_key(OPERATOR, "tenant-a") == KEY_A  # deterministic
    assert KEY_A.split(b":")[-1] != derive_tenant_key(b"another operator", "tenant-a").split(b":")[-1]
    with pytest.raises(InputError):
        derive_tenant_key(KEY_B, "tenant-a")  # a tenant's key derives nobody's
    for bad in ("", "..", ".hidden", "a/b", "x" * 65):
        with pytest.raises(InputError):
            derive_tenant_key(OPERATOR, bad)


def test_tenant_b_naming_tenant_a_grafts_nothing_of_tenant_as(server):
    a = tenant(server.url, KEY_A)
    assert a.namespace == "tenant-a"
    ref = a.deposit(DOC_A)
    question = "Who built the lighthouse?"
    answer = a.generate(question, states=[ref], max_new_tokens=4)
    a.memo.memoize(question, answer, states=[ref], provenance=Provenance(kind="person", by="tenant-a"))
    assert a.generate(question, states=[ref], max_new_tokens=4).receipt.mode == "memo"

    b = tenant(server.url, KEY_B, namespace="tenant-a")  # b's own key, a's name
    assert b.ref(DOC_A).key != ref.key  # cannot even compute a's address
    by_text = b.generate(question, states=[DOC_A], max_new_tokens=4)
    assert by_text.receipt.mode == "text-prefill" and by_text.receipt.states[0].reason == "missing"
    by_ref = b.generate(question, states=[ref], max_new_tokens=4)  # a's own ref, handed over
    assert by_ref.receipt.mode == "text-prefill" and by_ref.receipt.states[0].reason == "foreign"
    assert by_ref.receipt.first_token_logits_sha256 == text_logits(DOC_A, question)
    assert b.memo.entry(question, [DOC_A]) is None


def test_tenant_b_cannot_forge_a_state_or_a_memo_entry_for_tenant_a(server):
    a, b = tenant(server.url, KEY_A), tenant(server.url, KEY_B, namespace="tenant-a")
    ref = a.deposit(DOC_A)
    genuine = a.store.read(ref.key)
    b.store.put(ref.key, resigned(b, genuine.manifest), genuine.payload)  # b signs a manifest at a's address
    answer = a.generate(QUESTION, states=[ref], max_new_tokens=1)
    assert answer.receipt.mode == "text-prefill" and answer.receipt.states[0].reason == "signature"
    assert answer.receipt.first_token_logits_sha256 == text_logits()

    # a's memo entry, found by listing the store, rewritten by b under b's key: never answers for a
    a.store.delete(ref.key)
    ref = a.deposit(DOC_A)
    answer = a.generate(QUESTION, states=[ref], max_new_tokens=4)
    a.memo.memoize(QUESTION, answer, states=[ref], provenance=Provenance(kind="person", by="tenant-a"))
    (slot,) = list(a.records.names("memo"))
    body = a.records.get(slot)
    assert body is not None and a.generate(QUESTION, states=[ref], max_new_tokens=4).receipt.mode == "memo"
    b.records.put(slot, body)  # the same entry, sealed with b's key
    assert a.memo.entry(QUESTION, [ref]) is None
    assert a.generate(QUESTION, states=[ref], max_new_tokens=4).receipt.mode == "exact-graft"


def test_the_operator_key_acts_as_any_tenant_and_refs_carry_no_address_secret(server):
    a = tenant(server.url, KEY_A)
    ref = a.deposit(DOC_A)
    operator = KVEngine(tiny("llama"), f"{server.url}?namespace=tenant-a", signing_key=OPERATOR)
    assert operator.signing_key == KEY_A and operator.ref(DOC_A).key == ref.key
    assert operator.generate(QUESTION, states=[ref], max_new_tokens=1).receipt.mode == "exact-graft"
    # the ref names its scope by a hash of it: nothing in it computes a key
    assert ref.scope == a.identity.scope_id != a.identity.scope
    ids = a.plan([DOC_A])[0].ids
    assert state_key(ref.scope, None, ids) != ref.key and state_key(a.identity.scope, None, ids) == ref.key
    # the operator's own (no namespace) states are apart from every tenant's
    assert KVEngine(tiny("llama"), server.url, signing_key=OPERATOR).ref(DOC_A).key != ref.key


def test_kvrag_tenant_key_prints_the_derived_key_and_refuses_a_bad_name():
    import os
    import subprocess
    import sys

    env = {**os.environ, "KVRAG_SIGNING_KEY": OPERATOR.decode()}
    printed = subprocess.run([sys.executable, "-m", "kvrag.cli", "tenant-key", "tenant-a"], capture_output=True,
                             text=True, env=env, timeout=60)
    assert printed.returncode == 0 and printed.stdout.strip() == KEY_A.decode()
    refused = subprocess.run([sys.executable, "-m", "kvrag.cli", "tenant-key", ".."], capture_output=True, text=True,
                             env=env, timeout=60)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert [line for line in refused.stderr.splitlines() if line.strip()][0].startswith("error:")
