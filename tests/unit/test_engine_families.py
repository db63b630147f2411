"""Per model family: graft and text fallback agree byte for byte, and only own-position grafts are exact."""

import json

import pytest

from kvrag import KVEngine, MemoryStore
from kvrag.artifacts.format import parse_manifest

from ..conftest import DOC_A, DOC_B, DOC_C, DTYPES, FAMILIES, QUESTION, resigned, tiny


def _engine(family, dtype="float32", attn="sdpa"):
    return KVEngine(tiny(family, dtype, attn), MemoryStore())


def _other_model_manifest(engine, raw: bytes) -> bytes:
    data = json.loads(raw)
    data["model_fingerprint"]["weights_sha256"] = "f" * 64
    return resigned(engine, data)


def _wrongly_signed(raw: bytes) -> bytes:
    data = json.loads(raw)
    data["signature"] = ("1" if data["signature"][0] == "0" else "0") + data["signature"][1:]
    return json.dumps(data).encode()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_graft_and_every_fallback_give_the_same_logits(family, dtype):
    engine = _engine(family, dtype)
    ref = engine.deposit(DOC_A)
    graft = engine.generate(QUESTION, states=[ref], max_new_tokens=6)
    assert graft.receipt.mode == "exact-graft" and graft.receipt.exact
    assert graft.receipt.tokens_reused == ref.token_count

    store = engine.store
    manifest, payload = store.read_manifest(ref.key), store.read(ref.key).payload
    damaged = bytearray(payload)
    damaged[len(damaged) // 2] ^= 0x01
    cases = {
        "graft-off": lambda: None,
        "missing": lambda: store.delete(ref.key),
        "integrity": lambda: store.put(ref.key, manifest, bytes(damaged)),
        "foreign": lambda: store.put(ref.key, _other_model_manifest(engine, manifest), payload),
        "signature": lambda: store.put(ref.key, _wrongly_signed(manifest), payload),
    }
    for reason, damage in cases.items():
        store.put(ref.key, manifest, payload)
        damage()
        fallback = engine.generate(QUESTION, states=[ref], max_new_tokens=6, graft=reason != "graft-off")
        assert fallback.receipt.mode == "text-prefill", reason
        assert fallback.receipt.states[0].reason == reason
        assert fallback.receipt.first_token_logits_sha256 == graft.receipt.first_token_logits_sha256, reason
        assert fallback.tokens == graft.tokens, reason


@pytest.mark.parametrize("family", FAMILIES)
def test_a_state_anywhere_but_its_own_position_is_never_exact(family):
    engine = _engine(family)
    a, b = engine.deposit_chain([DOC_A, DOC_B])
    c = engine.deposit(DOC_C)  # a root state

    moved = engine.generate(QUESTION, states=[b], max_new_tokens=2)  # b without its parent
    assert moved.receipt.mode == "text-prefill"
    assert moved.receipt.states[0].source == "text"
    assert moved.receipt.states[0].reason == "moved" and moved.receipt.states[0].requested_key == b.key

    swapped = engine.generate(QUESTION, states=[c, b], max_new_tokens=2)  # c is fine, b is after the wrong parent
    assert swapped.receipt.mode == "partial-graft"
    assert [s.source for s in swapped.receipt.states] == ["graft", "text"]
    assert swapped.receipt.states[1].reason == "moved"

    # A state's bytes planted under the key of another position are refused, not grafted.
    expected_key = engine.plan([DOC_B])[0].key
    engine.store.put(expected_key, engine.store.read_manifest(b.key), engine.store.read(b.key).payload)
    planted = engine.generate(QUESTION, states=[DOC_B], max_new_tokens=2)
    assert planted.receipt.mode == "text-prefill" and planted.receipt.states[0].reason == "integrity"
    assert planted.receipt.first_token_logits_sha256 == moved.receipt.first_token_logits_sha256


@pytest.mark.parametrize("family", FAMILIES)
def test_chains_graft_exactly_and_partial_chains_stay_exact(family):
    engine = _engine(family)
    refs = engine.deposit_chain([DOC_A, DOC_B, DOC_C])
    assert [r.start for r in refs] == [0, refs[0].token_count, refs[0].token_count + refs[1].token_count]
    full = engine.generate(QUESTION, states=refs, max_new_tokens=4)
    text = engine.generate(QUESTION, states=refs, max_new_tokens=4, graft=False)
    assert full.receipt.mode == "exact-graft"
    assert full.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256

    engine.store.delete(refs[1].key)
    partial = engine.generate(QUESTION, states=refs, max_new_tokens=4)
    assert partial.receipt.mode == "partial-graft"
    assert [s.source for s in partial.receipt.states] == ["graft", "text", "graft"]
    assert partial.receipt.first_token_logits_sha256 == full.receipt.first_token_logits_sha256

    # Plain texts find the same content-addressed states; deposit_missing fills the gap for next time.
    again = engine.generate(QUESTION, states=[DOC_A, DOC_B, DOC_C], max_new_tokens=4, deposit_missing=True)
    assert again.receipt.mode == "partial-graft"
    assert engine.generate(QUESTION, states=[DOC_A, DOC_B, DOC_C], max_new_tokens=4).receipt.mode == "exact-graft"


def test_gemma3_sliding_layers_longer_than_the_window_restore_exactly():
    engine = _engine("gemma3")
    a, b = engine.deposit_chain([DOC_A, "Short tail."])
    for ref in (a, b):
        manifest = parse_manifest(engine.store.read_manifest(ref.key))
        window = manifest.layers[0].window
        sliding = [layer for layer in manifest.layers if layer.kind == "sliding"]
        full = [layer for layer in manifest.layers if layer.kind == "full"]
        assert sliding and full and ref.token_count + ref.start > window
        # Sliding layers hold exactly the window's tail, which for the short state reaches into its parent.
        assert all(layer.length == window - 1 and layer.first_position == manifest.end - (window - 1) for layer in sliding)
        assert all(layer.length == ref.token_count for layer in full)
    assert b.token_count < 32
    graft = engine.generate(QUESTION, states=[a, b], max_new_tokens=4)
    text = engine.generate(QUESTION, states=[a, b], max_new_tokens=4, graft=False)
    assert graft.receipt.mode == "exact-graft"
    assert graft.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256


def test_gemma3_refuses_a_sliding_state_that_does_not_hold_its_window():
    engine = _engine("gemma3")
    ref = engine.deposit(DOC_A)
    data = json.loads(engine.store.read_manifest(ref.key))
    for layer in data["layers"]:
        if layer["kind"] == "sliding":
            layer["window"] = 4096  # claims to hold the whole document
    engine.store.put(ref.key, resigned(engine, data), engine.store.read(ref.key).payload)
    generation = engine.generate(QUESTION, states=[ref], max_new_tokens=2)
    assert generation.receipt.mode == "text-prefill" and generation.receipt.states[0].reason == "integrity"


def test_stored_states_are_never_mutated_by_generation(llama_engine):
    ref = llama_engine.deposit(DOC_A)
    payload_before = bytes(llama_engine.store.read(ref.key).payload)
    for _ in range(2):
        llama_engine.generate(QUESTION, states=[ref], max_new_tokens=8)
    assert bytes(llama_engine.store.read(ref.key).payload) == payload_before


class CountingStore(MemoryStore):
    def __init__(self):
        super().__init__()
        self.puts = 0

    def put(self, key, manifest, payload):
        self.puts += 1
        super().put(key, manifest, payload)


def test_deposit_is_idempotent_and_content_addressed():
    store = CountingStore()
    engine = KVEngine(tiny("llama"), store)
    first = engine.deposit(DOC_A)
    second = engine.deposit(DOC_A)
    assert first == second and store.puts == 1
    assert engine.ref(DOC_A) == first
    other = KVEngine(tiny("llama"), MemoryStore())
    assert other.ref(DOC_A).key == first.key  # same text, same model: same key anywhere
    assert KVEngine(tiny("qwen2"), MemoryStore()).ref(DOC_A).key != first.key


def test_receipt_reports_timings_and_counts(llama_engine):
    ref = llama_engine.deposit(DOC_A)
    receipt = llama_engine.generate(QUESTION, states=[ref], max_new_tokens=5).receipt
    assert receipt.tokens_reused == ref.token_count
    assert receipt.tokens_prefilled == len(llama_engine.layout.question_ids(QUESTION))
    assert 1 <= receipt.decode_tokens <= 5
    t = receipt.timings
    assert 0 <= t.restore_ms <= t.ttft_ms <= t.total_ms and t.prefill_ms > 0
    assert t.ttft_ms + t.decode_ms <= t.total_ms
    if receipt.decode_tokens > 1:  # time per token: the steps after the first token, each
        assert t.per_token_ms > 0 and abs(t.per_token_ms * (receipt.decode_tokens - 1) - t.decode_ms) < 1e-6 * t.decode_ms + 1e-9
    one = llama_engine.generate(QUESTION, states=[ref], max_new_tokens=1).receipt
    assert one.decode_tokens == 1 and one.timings.per_token_ms == 0
    assert receipt.model_fingerprint == llama_engine.fingerprint
    assert receipt.states[0].tier == "memory://"
    json.loads(receipt.model_dump_json())


def test_generation_without_documents(llama_engine):
    generation = llama_engine.generate(QUESTION, max_new_tokens=3)
    assert generation.receipt.mode == "text-prefill" and generation.receipt.states == []
