"""Tenants sharing one Redis cannot read or probe each other's states; machines of other hardware
no longer overwrite each other's states of the same text."""

from __future__ import annotations

import torch

from kvrag import KVEngine

from ..conftest import DOC_A, QUESTION, tiny
from .conftest import engine


def test_tenants_have_their_own_keys_and_cannot_use_each_others_states(server):
    alice = engine(f"{server.url}?namespace=alice")
    bob = engine(server.url, namespace="bob")
    ref = alice.deposit(DOC_A)
    assert bob.ref(DOC_A).key != ref.key  # the same text, another address
    assert not bob.holds(bob.ref(DOC_A))  # bob cannot tell alice read this text
    answer = bob.generate(QUESTION, states=[ref], max_new_tokens=1)
    assert answer.receipt.mode == "text-prefill" and answer.receipt.states[0].reason == "foreign"
    # Without alice's signing key nobody can compute her addresses, even knowing her namespace.
    stranger = engine(f"{server.url}?namespace=alice", signing_key="stranger")
    assert stranger.ref(DOC_A).key != ref.key


def test_other_hardware_keeps_its_own_states_under_its_own_keys(server):
    """Under sdpa, whose bits depend on the thread count (the invariant kernel's do not)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KVEngine(tiny("llama", attn="sdpa"), server.url)
        ref_one = one.deposit(DOC_A)
        torch.set_num_threads(2)
        two = KVEngine(tiny("llama", attn="sdpa"), server.url)
        ref_two = two.deposit(DOC_A)
        assert ref_one.key != ref_two.key
        assert two.generate(QUESTION, states=[ref_two], max_new_tokens=1).receipt.mode == "exact-graft"
        torch.set_num_threads(1)
        assert one.generate(QUESTION, states=[ref_one], max_new_tokens=1).receipt.mode == "exact-graft"
    finally:
        torch.set_num_threads(threads)
