"""Several documents per question: the honest A/B policies, the exact levers, and the gated blend."""

from __future__ import annotations

import pytest

from kvrag import KVEngine, MemoryStore
from kvrag.apps.ab import run_ab
from kvrag.core.continuation import Continuation, plan_segments
from kvrag.core.protocol import BlendLimits
from kvrag.reuse.gate import kl_divergence
from kvrag.reuse.levers import ChainWarmer, stored_prefix_first
from tests.conftest import DOC_A, DOC_B, DOC_C, tiny

DOC_D = "The harbour at Kells was dredged in 1930. Fishing boats still land their catch there every morning."
DOCS = [{"id": str(i), "title": str(i), "text": t} for i, t in enumerate([DOC_A, DOC_B, DOC_C, DOC_D])]
QUESTIONS = [
    {"id": "q1", "question": "Who built the lighthouse tower?", "answers": ["Quill"]},
    {"id": "q2", "question": "When was the lamp electrified and the tower built?", "answers": ["1952"]},
    {"id": "q3", "question": "How many steps lead to the lantern room of the tower?", "answers": ["212"]},
    {"id": "q4", "question": "When was the harbour at Kells dredged?", "answers": ["1930"]},
    {"id": "q5", "question": "Who was the last keeper of the lamp and the tower?", "answers": ["1988"]},
]


#: Limits a random tiny model's blends can meet: set on the engine by its owner, never by a verdict.
LOOSE = BlendLimits(max_mean_kl=10.0, min_agreement=0.0)


def engine(family: str = "llama", **kwargs) -> KVEngine:
    return KVEngine(tiny(family), MemoryStore(), **kwargs)


def test_stored_prefix_first_finds_the_longest_stored_chain_and_keeps_the_rest_in_order():
    e = engine()
    e.deposit_chain([DOC_C, DOC_A])
    assert stored_prefix_first(e, [DOC_A, DOC_B, DOC_C]) == [DOC_C, DOC_A, DOC_B]
    assert stored_prefix_first(e, [DOC_B, DOC_D]) == [DOC_B, DOC_D]  # nothing stored: unchanged
    e.deposit(DOC_D)
    assert stored_prefix_first(e, [DOC_B, DOC_D]) == [DOC_D, DOC_B]


def test_lazy_reports_what_an_application_gets_and_warm_what_a_stored_chain_gives():
    lazy = run_ab(engine(), DOCS, QUESTIONS, k=3, max_new_tokens=3, policy="lazy")
    warm = run_ab(engine(), DOCS, QUESTIONS, k=3, max_new_tokens=3, policy="warm")
    assert warm.mode_mix == {"exact-graft": len(QUESTIONS)} and warm.full_hit_rate == 1.0
    assert lazy.mode_mix.get("partial-graft", 0) > 0 and lazy.full_hit_rate < 1.0
    assert lazy.upfront_deposit_ms > 0 and warm.upfront_deposit_ms == 0 and warm.deposit_before_ms > 0
    assert lazy.token_reuse_rate < warm.token_reuse_rate
    assert set(lazy.ttft_ratio_by_mode) == set(lazy.mode_mix)
    for summary in (lazy, warm):
        assert summary.logits_byte_exact_rate == 1.0 and summary.answer_agreement == 1.0


def test_stored_first_order_reorders_both_arms_and_stays_byte_exact():
    e = engine()
    e.deposit_chain([DOC_C, DOC_A, DOC_B])
    summary = run_ab(e, DOCS, QUESTIONS, k=3, max_new_tokens=3, policy="lazy", order="stored-first")
    assert any(r.order_changed for r in summary.rows)
    assert all(r.logits_sha256_text == r.logits_sha256_kv for r in summary.rows if r.kv_mode != "memo")
    assert summary.levers == ["stored-first"]


def test_a_corpus_chain_grafts_the_whole_corpus_for_every_question():
    summary = run_ab(engine(), DOCS, QUESTIONS, k=1, max_new_tokens=3, policy="lazy", corpus_chain=True)
    assert summary.mode_mix == {"exact-graft": len(QUESTIONS)} and summary.logits_byte_exact_rate == 1.0


def test_chain_warming_deposits_both_orders_of_pairs_that_recur_within_its_budget():
    e = engine()
    for text in (DOC_A, DOC_B, DOC_C):
        e.deposit(text)
    warmer = ChainWarmer(e, min_count=2)
    warmer.observe([DOC_A, DOC_B])
    assert warmer.drain() == 0  # seen once: nothing yet
    warmer.observe([DOC_B, DOC_A, DOC_C])
    assert warmer.drain() == 2
    assert e.holds(e.ref(DOC_B, after=e.ref(DOC_A))) and e.holds(e.ref(DOC_A, after=e.ref(DOC_B)))
    assert ChainWarmer(e, min_count=1, budget_mib=0).drain() == 0


def test_blending_with_every_token_recomputed_reproduces_the_exact_path():
    e = engine()
    roots = [e.deposit(DOC_A), e.deposit(DOC_B)]
    segments = e.plan([DOC_A, DOC_B])
    feed = e.planner.question("Who built it?", segments)
    scope = e.identity.scope_id
    exact = e.run(Continuation(plan_segments(segments, graft=False), feed, 1)).result()
    full = e.run(Continuation(plan_segments(segments, roots, scope=scope, blend=1.0), feed, 1)).result()
    partial = e.run(Continuation(plan_segments(segments, roots, scope=scope, blend=0.15), feed, 1)).result()
    moved = e.run(Continuation(plan_segments(segments, roots, scope=scope, approximate=True), feed, 1)).result()
    assert kl_divergence(exact.first_token_logits, full.first_token_logits) < 1e-6
    assert kl_divergence(exact.first_token_logits, partial.first_token_logits) < kl_divergence(
        exact.first_token_logits, moved.first_token_logits)
    for blended, ratio in ((full, 1.0), (partial, 0.15)):
        assert blended.receipt.mode == "approximate-graft" and blended.receipt.exact is False
        assert blended.receipt.recompute_ratio == ratio


def test_blend_asked_for_without_a_passed_gate_answers_exactly_and_says_why():
    e = engine()
    e.deposit(DOC_A), e.deposit(DOC_B)
    answer = e.generate("Who built it?", states=[DOC_A, DOC_B], blend=True, max_new_tokens=2)
    assert answer.receipt.exact and answer.receipt.mode == "partial-graft"
    assert "not calibrated" in answer.receipt.notes[0]
    refused = e.gate.calibrate([DOC_A, DOC_B, DOC_C], samples=2, max_mean_kl=0.0, min_agreement=1.0)
    assert not refused.passed
    answer = e.generate("Who built it?", states=[DOC_A, DOC_B], blend=True, max_new_tokens=2)
    assert answer.receipt.exact and "refused" in answer.receipt.notes[0]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_blended_ab_rows_are_never_labelled_exact(family):
    e = engine(family, blend_limits=LOOSE)
    assert e.gate.calibrate([DOC_A, DOC_B, DOC_C, DOC_D], samples=3).passed
    summary = run_ab(e, DOCS, QUESTIONS, k=3, max_new_tokens=3, policy="lazy", blend=0.15)
    approximate = [r for r in summary.rows if r.kv_mode == "approximate-graft"]
    assert approximate and summary.approximate_rows == len(approximate)
    assert all(r.kl_vs_text >= 0 for r in approximate)
    assert summary.blend_gate is not None and summary.blend_gate["passed"]
    assert all(r.kv_mode != "exact-graft" or r.logits_sha256_kv == r.logits_sha256_text for r in summary.rows)


def test_gpt2_and_sliding_window_models_do_not_blend():
    for family in ("gpt2", "gemma3"):
        e = engine(family)
        roots = [e.deposit(DOC_A), e.deposit(DOC_B)]
        segments = e.plan([DOC_A, DOC_B])
        steps = plan_segments(segments, roots, scope=e.identity.scope_id, blend=0.15)
        answer = e.run(Continuation(steps, e.planner.question("Who?", segments), 1)).result()
        assert answer.receipt.exact and answer.receipt.mode == "partial-graft"


def test_the_gate_verdict_is_shown_by_ls_and_inspect(tmp_path):
    import json

    from typer.testing import CliRunner

    from kvrag.cli import app

    store = f"disk://{tmp_path}"
    e = KVEngine(tiny("llama"), store, blend_limits=LOOSE)
    e.gate.calibrate([DOC_A, DOC_B, DOC_C], samples=2)
    shown = json.loads(CliRunner().invoke(app, ["inspect", "gates", "--store", store]).stdout)
    assert [(g["model"], g["model_fingerprint"]) for g in shown] == [("tiny-random-llama", e.fingerprint)]
    # shown as an engine with the default limits judges it, whatever limits the verdict was made under
    within = shown[0]["kl_mean"] <= BlendLimits().max_mean_kl and shown[0]["argmax_agreement"] >= BlendLimits().min_agreement
    assert shown[0]["passed"] is within
    listed = CliRunner().invoke(app, ["ls", "--store", store])
    assert listed.exit_code == 0 and "blend gates" in listed.stdout
    assert ("allowed" if within else "refused") in listed.stdout
