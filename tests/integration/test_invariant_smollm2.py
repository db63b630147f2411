"""The invariant kernel on the real model: grafts equal one stock transformers pass, byte for byte."""

import pytest
import torch

from kvrag import KVEngine, MemoryStore, load_model
from kvrag.apps.verify import verify_model
from kvrag.core.prefixes import common_prefix
from kvrag.core.runner import logits_sha256
from kvrag.core.transcript import Message

from ..conftest import DOC_A, DOC_B, QUESTION, first_token_sha_at_threads

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_invariant():
    return load_model("smollm2-135m", attn="invariant")


def test_verify_against_one_stock_pass_is_byte_exact(smollm2_invariant):
    report = verify_model(smollm2_invariant, samples=6)
    assert report.byte_exact == report.fallback_byte_exact == 6
    assert report.monolithic.byte_exact == 6 and report.monolithic.kl_max == 0.0


def test_a_template_never_seen_reuses_a_stored_prefix_and_equals_one_stock_pass(smollm2_invariant):
    """A LangChain-style prompt was stored; a prompt that differs from it inside a stored segment
    (one word of the second document) grafts exactly the tokens the two share, up to the first
    token where they part, and its first-token logits and answer are one stock pass's."""
    model = smollm2_invariant
    engine = KVEngine(model, MemoryStore())
    system = "Use the following pieces of retrieved context to answer the question.\n\n" + DOC_A + "\n" + DOC_B
    stored = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    engine.deposit_chat(stored)
    asked = [{"role": "system", "content": system.replace("in 1952", "in 1953")}, {"role": "user", "content": QUESTION}]
    stored_ids = engine.renderer.render([Message(**m) for m in stored], generation_prompt=False).ids
    ids = engine.renderer.render([Message(**m) for m in asked]).ids
    shared = common_prefix(stored_ids, ids)
    segments = engine.planner.chain(engine.renderer.render([Message(**m) for m in stored], generation_prompt=False).pieces())
    assert any(s.start < shared < s.end for s in segments)  # the edit is inside a stored segment
    assert shared > 64  # past the first prefix record

    kv = engine.chat(asked, max_new_tokens=12)
    assert kv.receipt.tokens_reused == shared and kv.receipt.exact
    with torch.inference_mode():
        stock = model.hf_model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
        generated = model.hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                            eos_token_id=sorted(engine.layout.stop_ids), pad_token_id=0)
    assert kv.receipt.first_token_logits_sha256 == logits_sha256(stock)
    stock_tokens = [t for t in generated[0, len(ids):].tolist() if t not in engine.layout.stop_ids]
    assert kv.tokens[: len(stock_tokens)] == stock_tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_invariant_kernel_gives_the_same_bits_at_1_and_2_threads(dtype):
    """What lets the hardware fingerprint leave the thread count out under this kernel."""
    model = load_model("smollm2-135m", dtype=dtype, attn="invariant")
    shas = first_token_sha_at_threads(model, [DOC_A, DOC_B], QUESTION)
    assert shas[0] == shas[1]
