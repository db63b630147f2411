"""The invariant kernel on the real model: grafts equal one stock transformers pass, byte for byte."""

import pytest
import torch

from kvrag import KVEngine, MemoryStore, load_model
from kvrag.apps.verify import verify_model
from kvrag.core.runner import logits_sha256
from kvrag.core.transcript import Message

from ..conftest import DOC_A, DOC_B, QUESTION

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_invariant():
    return load_model("smollm2-135m", attn="invariant")


def test_verify_against_one_stock_pass_is_byte_exact(smollm2_invariant):
    report = verify_model(smollm2_invariant, samples=6)
    assert report.byte_exact == report.fallback_byte_exact == 6
    assert report.monolithic.byte_exact == 6 and report.monolithic.kl_max == 0.0


def test_a_template_never_seen_reuses_a_stored_prefix_and_equals_one_stock_pass(smollm2_invariant):
    """A LangChain-style prompt was stored; a differently worded prompt over the same documents
    (another template: the edit falls inside a stored segment) grafts up to the first token where
    the two part, and its first-token logits and answer are one stock pass's."""
    model = smollm2_invariant
    engine = KVEngine(model, MemoryStore())
    system = "Use the following pieces of retrieved context to answer the question.\n\n" + DOC_A + "\n" + DOC_B
    engine.deposit_chat([{"role": "system", "content": system}, {"role": "user", "content": QUESTION}])
    other = system.replace("Use the following pieces", "Use these pieces").replace(DOC_B, DOC_B + " Be brief.")
    asked = [{"role": "system", "content": system + "\nAnswer in one sentence."}, {"role": "user", "content": QUESTION}]
    ids = engine.renderer.render([Message(**m) for m in asked]).ids

    kv = engine.chat(asked, max_new_tokens=12)
    assert kv.receipt.tokens_reused > 100 and kv.receipt.exact
    with torch.inference_mode():
        stock = model.hf_model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
        generated = model.hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                            eos_token_id=sorted(engine.layout.stop_ids), pad_token_id=0)
    assert kv.receipt.first_token_logits_sha256 == logits_sha256(stock)
    stock_tokens = [t for t in generated[0, len(ids):].tolist() if t not in engine.layout.stop_ids]
    assert kv.tokens[: len(stock_tokens)] == stock_tokens

    # a prompt that differs from the first token of the documents on grafts only what it shares
    fresh = engine.chat([{"role": "system", "content": other}, {"role": "user", "content": QUESTION}], max_new_tokens=1)
    assert fresh.receipt.tokens_reused < kv.receipt.tokens_reused
