"""A stored gate verdict cannot certify a blend the engine's own limits refuse: not one sealed with
the key but measured under loose thresholds, not a calibration asked to loosen them."""

from __future__ import annotations

import pytest

from kvrag import InputError, KVEngine, MemoryStore
from kvrag.core.protocol import BlendLimits
from kvrag.reuse.gate import GateResult

from ..conftest import DOC_A, DOC_B, DOC_C, tiny


def _verdict(engine: KVEngine, **figures) -> GateResult:
    """A verdict as a key holder could seal it into the gate's slot: `passed`, whatever it says."""
    verdict = GateResult(model=engine.model.name, model_fingerprint=engine.fingerprint,
                         hardware_fingerprint=engine.identity.hardware.digest, ratio=0.15, rerotate=True, samples=8,
                         kl_max=figures["kl_mean"], max_mean_kl=10.0, min_agreement=0.0, passed=True, **figures)
    engine.records.put(engine.gate.slot(0.15, True), verdict.model_dump_json().encode())
    return verdict


@pytest.mark.parametrize("figures", [{"kl_mean": 5.0, "argmax_agreement": 1.0},
                                     {"kl_mean": 0.01, "argmax_agreement": 0.0}])
def test_a_loose_verdict_is_refused_and_the_answer_stays_exact(figures):
    engine = KVEngine(tiny("llama"), MemoryStore())
    _verdict(engine, **figures)
    assert engine.gate.result() is not None and engine.gate.result().passed  # stored, sealed, says passed
    assert "refused" in engine.gate.refusal()
    engine.deposit(DOC_A), engine.deposit(DOC_B)
    answer = engine.generate("Who built it?", states=[DOC_A, DOC_B], blend=True, max_new_tokens=2)
    assert answer.receipt.exact and answer.receipt.mode == "partial-graft" and "refused" in answer.receipt.notes[0]


def test_a_verdict_within_the_limits_lets_the_blend_through():
    engine = KVEngine(tiny("llama"), MemoryStore())
    _verdict(engine, kl_mean=0.01, argmax_agreement=1.0)
    assert engine.gate.refusal() is None


def test_a_calibration_cannot_loosen_the_engines_limits():
    engine = KVEngine(tiny("llama"), MemoryStore())
    with pytest.raises(InputError, match="cannot loosen"):
        engine.gate.calibrate([DOC_A, DOC_B, DOC_C], samples=1, max_mean_kl=10.0, min_agreement=0.0)
    # an engine whose owner set looser limits judges by them (and says so in its own setting)
    loose = KVEngine(tiny("llama"), MemoryStore(), blend_limits=BlendLimits(10.0, 0.0))
    assert loose.gate.calibrate([DOC_A, DOC_B, DOC_C], samples=1).max_mean_kl == 10.0
