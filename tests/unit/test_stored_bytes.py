"""A property over stored bytes: whatever a writer to the store changes in a state, the answer is
either a graft with the text's exact logits, or the text itself (the state refused)."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrag import KVEngine, MemoryStore

from ..conftest import DOC_A, QUESTION, tiny

STORE = MemoryStore()
ENGINE = KVEngine(tiny("llama"), STORE)
REF = ENGINE.deposit(DOC_A)
GENUINE = STORE.read(REF.key)
MANIFEST, PAYLOAD = GENUINE.manifest, bytes(GENUINE.payload)
TEXT = ENGINE.generate(QUESTION, states=[REF], max_new_tokens=1, graft=False).receipt.first_token_logits_sha256

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6,
)


def _flip(data: bytes, draw, count: int) -> bytes:
    out = bytearray(data)
    for _ in range(count):
        out[draw(st.integers(0, len(out) - 1))] ^= draw(st.integers(1, 255))
    return bytes(out)


def _field_replaced(draw) -> bytes:
    data = json.loads(MANIFEST)
    path = draw(st.sampled_from(sorted(data) + ["deposit.verified", "deposit.canary_logits_sha256", "layers.0.length",
                                                "layers.0.first_position", "token_ids.0", "start"]))
    target, key = data, path
    for part in path.split(".")[:-1]:
        target = target[int(part)] if isinstance(target, list) else target[part]
    key = path.split(".")[-1]
    target[int(key) if isinstance(target, list) else key] = draw(json_values)
    return json.dumps(data).encode()


@st.composite
def mutations(draw) -> tuple[str, bytes, bytes]:
    kind = draw(st.sampled_from(["manifest-bytes", "manifest-field", "payload-bytes", "payload-header", "payload-cut",
                                 "both"]))
    manifest, payload = MANIFEST, PAYLOAD
    if kind in ("manifest-bytes", "both"):
        manifest = _flip(manifest, draw, draw(st.integers(1, 3)))
    if kind == "manifest-field":
        manifest = _field_replaced(draw)
    if kind in ("payload-bytes", "both"):
        payload = _flip(payload, draw, draw(st.integers(1, 3)))
    if kind == "payload-header":
        header = int.from_bytes(PAYLOAD[:8], "little") + 8
        payload = bytearray(PAYLOAD)
        payload[draw(st.integers(0, header - 1))] = draw(st.integers(0, 255))
        payload = bytes(payload)
    if kind == "payload-cut":
        payload = PAYLOAD[: draw(st.integers(0, len(PAYLOAD) - 1))]
    return kind, manifest, payload


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations())
def test_a_mutated_state_is_refused_or_grafts_the_texts_logits(mutation):
    _, manifest, payload = mutation
    STORE.put(REF.key, manifest, payload)
    try:
        generation = ENGINE.generate(QUESTION, states=[REF], max_new_tokens=1, memo=False)
    finally:
        STORE.put(REF.key, MANIFEST, PAYLOAD)
    receipt = generation.receipt
    assert receipt.first_token_logits_sha256 == TEXT
    if (manifest, payload) == (MANIFEST, PAYLOAD):  # a mutation that changed nothing grafts
        assert receipt.mode == "exact-graft"
    else:  # any changed byte is refused, and the receipt says why
        assert receipt.mode == "text-prefill"
        assert receipt.states[0].reason in ("integrity", "signature", "foreign", "missing")


def test_the_genuine_state_grafts():
    receipt = ENGINE.generate(QUESTION, states=[REF], max_new_tokens=1, memo=False).receipt
    assert receipt.mode == "exact-graft" and receipt.first_token_logits_sha256 == TEXT
