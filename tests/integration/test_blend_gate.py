"""The blend gate on the real model: it lets a sound blend through and refuses a broken one."""

from __future__ import annotations

import pytest

from kvrag import KVEngine, MemoryStore
from kvrag.data import sample_docs

pytestmark = pytest.mark.slow


def test_the_gate_allows_a_re_rotated_blend_and_refuses_moving_without_re_rotation(smollm2):
    engine = KVEngine(smollm2, MemoryStore())
    # Measured here: mean KL 0.081 (agreement 7/8) re-rotated, 0.164 without re-rotation.
    sound = engine.gate.calibrate(samples=8)
    broken = engine.gate.calibrate(samples=8, rerotate=False)
    assert sound.passed and sound.kl_mean <= sound.max_mean_kl
    assert not broken.passed and broken.kl_mean > sound.kl_mean
    assert engine.gate.refusal() is None and "refused" in engine.gate.refusal(rerotate=False)
    # The verdict is bound to the model: another dtype's engine on the same store has none.
    assert engine.gate.result() == sound

    docs = [d.text for d in sample_docs()]
    engine.deposit(docs[0]), engine.deposit(docs[3])
    answer = engine.generate("Who built the lighthouse?", states=[docs[0], docs[3]], blend=True, max_new_tokens=4)
    assert answer.receipt.mode == "approximate-graft" and not answer.receipt.exact
    assert answer.receipt.recompute_ratio == 0.15 and answer.receipt.notes == []
