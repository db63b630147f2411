"""Skewed question streams for `kvrag ab`, the canonical order, and what the A/B summary reports
about them."""

from __future__ import annotations

from collections import Counter

import pytest

from kvrag import InputError, KVEngine, MemoryStore
from kvrag.apps.ab import load_jsonl, run_ab, skewed_stream
from kvrag.data import sample_paths
from kvrag.reuse.levers import canonical_order
from tests.conftest import DOC_A, DOC_B, DOC_C, tiny

DOCS = load_jsonl(sample_paths()[0], ["id", "text"])
QUESTIONS = load_jsonl(sample_paths()[1], ["id", "question", "answers"])
# Short documents for the A/B runs on a tiny model (the bundled ones make each run minutes long)
SHORT_DOCS = [{"id": str(i), "title": str(i), "text": t} for i, t in enumerate(
    [DOC_A, DOC_B, DOC_C, "The harbour at Kells was dredged in 1930. Fishing boats still land their catch there."])]
SHORT_QUESTIONS = [
    {"id": "a", "question": "Who built the lighthouse tower?", "answers": ["Quill"], "doc_id": "0",
     "paraphrases": ["Which engineer built the tower of the lighthouse?"]},
    {"id": "b", "question": "When was the lamp electrified?", "answers": ["1952"], "doc_id": "1",
     "paraphrases": ["In what year did the lamp get electricity?"]},
    {"id": "c", "question": "How many steps lead to the lantern room?", "answers": ["212"], "doc_id": "2"},
    {"id": "d", "question": "When was the harbour at Kells dredged?", "answers": ["1930"], "doc_id": "3",
     "paraphrases": ["What year was Kells harbour dredged?"]},
]


def test_a_stream_is_its_seed_and_draws_questions_phrasings_and_no_marked_variants():
    stream = skewed_stream(DOCS, QUESTIONS, n=200, seed=7)
    assert stream == skewed_stream(DOCS, QUESTIONS, n=200, seed=7)
    assert stream != skewed_stream(DOCS, QUESTIONS, n=200, seed=8)
    assert len(stream) == 200 and len({q["id"] for q in stream}) == 200
    by_id = {q["id"]: q for q in QUESTIONS}
    seen = set()
    for q in stream:
        base = by_id[q["base_id"]]
        assert not base.get("recurring") and q["answers"] == base["answers"] and q["doc_id"] == base["doc_id"]
        assert q["question"] == [base["question"], *base["paraphrases"]][q["phrasing"]]
        assert q["recurring"] == ((q["base_id"], q["phrasing"]) in seen)
        seen.add((q["base_id"], q["phrasing"]))
    assert {q["phrasing"] for q in stream} == {0, 1, 2}


def test_zipf_concentrates_traffic_on_few_documents_and_uniform_does_not():
    def top_share(stream: list[dict]) -> float:
        counts = Counter(q["doc_id"] for q in stream)
        return counts.most_common(1)[0][1] / len(stream)

    zipf = skewed_stream(DOCS, QUESTIONS, n=2000, stream="zipf", s=1.1, seed=0)
    uniform = skewed_stream(DOCS, QUESTIONS, n=2000, stream="uniform", seed=0)
    # 8 documents: the most popular draws 1/H(8, 1.1) (about 0.38) under Zipf, 1/8 under uniform
    assert 0.33 < top_share(zipf) < 0.43 and 0.10 < top_share(uniform) < 0.16


def test_a_stream_needs_questions_that_name_their_documents():
    with pytest.raises(InputError, match="doc_id"):
        skewed_stream(DOCS, [{"id": "x", "question": "?", "answers": ["a"]}], n=3)
    with pytest.raises(InputError):
        skewed_stream(DOCS, QUESTIONS, n=0)


def test_the_canonical_order_is_one_order_whatever_the_retriever_returned():
    texts = [str(d["text"]) for d in DOCS[:5]]
    first = canonical_order(texts)
    assert sorted(first) == sorted(texts)
    for shift in range(1, 5):
        assert canonical_order(texts[shift:] + texts[:shift]) == first
    assert canonical_order(list(reversed(texts))) == first


def test_a_recurring_set_grafts_whole_under_the_canonical_order_and_accuracy_in_retrieval_order_is_reported():
    """On a skewed stream at k=3, lazy with the canonical order: every question whose set of
    documents came before (in any order) grafts its whole context, exactly; the summary reports
    text RAG in retrieval order beside both arms, the ratio of summed TTFTs and the bytes stored."""
    engine = KVEngine(tiny("llama"), MemoryStore())
    stream = skewed_stream(SHORT_DOCS, SHORT_QUESTIONS, n=7, seed=3)
    summary = run_ab(engine, SHORT_DOCS, stream, k=3, max_new_tokens=2, policy="lazy", order="canonical")
    seen: set[frozenset[str]] = set()
    for row in summary.rows:
        if frozenset(row.doc_ids) in seen:
            assert row.kv_mode in ("exact-graft", "memo"), row.id
        seen.add(frozenset(row.doc_ids))
        if row.kv_mode != "memo":
            assert row.logits_sha256_kv == row.logits_sha256_text
    assert len(seen) < len(summary.rows)  # the stream did recur
    assert summary.levers == ["canonical"]
    assert summary.accuracy_text_retrieval_order == sum(r.text_retrieval_order_hit for r in summary.rows) / summary.n
    assert summary.ttft_ratio_sum == pytest.approx(sum(r.ttft_text_ms for r in summary.rows) / sum(r.ttft_kv_ms for r in summary.rows))
    assert summary.bytes_stored > 0 and summary.ttft_ratio_p90 >= summary.ttft_ratio_median


def test_without_a_lever_accuracy_in_retrieval_order_is_the_text_arms():
    engine = KVEngine(tiny("llama"), MemoryStore())
    summary = run_ab(engine, SHORT_DOCS, skewed_stream(SHORT_DOCS, SHORT_QUESTIONS, n=4, seed=1), k=2, max_new_tokens=2)
    assert all(r.text_retrieval_order_hit == r.text_hit for r in summary.rows)
    assert summary.accuracy_text_retrieval_order == summary.accuracy_text


@pytest.mark.parametrize("lever", [{"order": "canonical"}, {"order": "stored-first"}, {"warm_chains": True},
                                   {"blend": 0.15}])
def test_at_k_1_the_order_the_warming_and_the_blend_change_nothing(lever):
    """One document per question: no order to change, no pair to warm, no second document to
    blend; the KV arm answers as plain lazy does, row for row."""
    stream = skewed_stream(SHORT_DOCS, SHORT_QUESTIONS, n=6, seed=2)
    plain, levered = (run_ab(KVEngine(tiny("llama"), MemoryStore()), SHORT_DOCS, stream, k=1, max_new_tokens=2, **options)
                      for options in ({}, lever))
    assert [(r.kv_mode, r.kv_answer, r.logits_sha256_kv) for r in levered.rows] == \
        [(r.kv_mode, r.kv_answer, r.logits_sha256_kv) for r in plain.rows]
    assert not any(r.order_changed for r in levered.rows)
    assert levered.approximate_rows == levered.warm_chains == 0
