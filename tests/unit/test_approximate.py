"""Approximate composition is opt-in, labelled, and measured, never passed off as exact."""

import pytest
import torch

from kvrag import KVEngine, MemoryStore
from kvrag.reuse import approximate as approx

from ..conftest import DOC_A, DOC_B, QUESTION, tiny


def _kl(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    p = torch.log_softmax(reference.double(), -1)
    q = torch.log_softmax(candidate.double(), -1)
    return float(torch.sum(p.exp() * (p - q)))


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3"])
def test_independent_chunks_compose_only_when_asked_and_are_labelled(family, monkeypatch):
    engine = KVEngine(tiny(family), MemoryStore())
    a, b = engine.deposit(DOC_A), engine.deposit(DOC_B)  # both computed at the start, independently
    exact = engine.generate(QUESTION, states=[a, b], max_new_tokens=1, graft=False)

    default = engine.generate(QUESTION, states=[a, b], max_new_tokens=1)
    assert default.receipt.mode == "partial-graft" and default.receipt.exact
    assert default.receipt.states[1].reason == "moved"
    assert default.receipt.first_token_logits_sha256 == exact.receipt.first_token_logits_sha256

    moved = engine.generate(QUESTION, states=[a, b], max_new_tokens=1, approximate=True)
    assert moved.receipt.mode == "approximate-graft" and moved.receipt.exact is False
    assert [s.source for s in moved.receipt.states] == ["graft", "approximate"]
    assert moved.receipt.tokens_reused == a.token_count + len(engine.layout.document_ids(DOC_B))
    kl = _kl(exact.first_token_logits, moved.first_token_logits)
    assert 0 < kl < 1.0, kl  # measured, not zero: it is approximate

    # The re-rotation is what makes a moved state usable: without it the error is larger.
    monkeypatch.setattr(approx, "rerotate_keys", lambda keys, delta, inv_freq: keys.clone())
    naive = engine.generate(QUESTION, states=[a, b], max_new_tokens=1, approximate=True)
    assert _kl(exact.first_token_logits, naive.first_token_logits) > kl


def test_a_chain_state_moved_to_the_front_reads_the_prefix_as_text():
    engine = KVEngine(tiny("llama"), MemoryStore())
    _, b = engine.deposit_chain([DOC_A, DOC_B])
    moved = engine.generate(QUESTION, states=[b], max_new_tokens=1, approximate=True)
    assert moved.receipt.mode == "approximate-graft" and not moved.receipt.exact
    assert moved.receipt.tokens_prefilled == len(engine.layout.prefix_ids) + len(engine.layout.question_ids(QUESTION))


@pytest.mark.parametrize("family, why", [("gpt2", "absolute positions"), ("gemma3", "sliding-window")])
def test_models_that_cannot_move_states_fall_back_to_text(family, why):
    engine = KVEngine(tiny(family), MemoryStore())
    a, b = engine.deposit(DOC_A), engine.deposit(DOC_B)
    generation = engine.generate(QUESTION, states=[a, b], max_new_tokens=1, approximate=True)
    assert generation.receipt.mode == "partial-graft" and generation.receipt.exact
    assert why in generation.receipt.states[1].detail


def test_rerotation_composes():
    inv_freq = torch.tensor([1.0, 0.1, 0.01, 0.001])
    keys = torch.randn(1, 2, 3, 8)
    twice = approx.rerotate_keys(approx.rerotate_keys(keys, 5, inv_freq), 7, inv_freq)
    once = approx.rerotate_keys(keys, 12, inv_freq)
    assert torch.allclose(twice, once, atol=1e-5)
    assert torch.allclose(approx.rerotate_keys(approx.rerotate_keys(keys, 9, inv_freq), -9, inv_freq), keys, atol=1e-5)
