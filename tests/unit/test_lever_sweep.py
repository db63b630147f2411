"""A lever measured on several independent streams (`kvrag.apps.ab.sweep`): the streams differ,
the intervals are honest about repeated questions, the figures are those of the runs, and the
position measurement moves only the question's own document."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvrag import InputError, KVEngine, MemoryStore
from kvrag.apps.ab import (
    BASELINE,
    Interval,
    LeverOnStream,
    StreamSpec,
    bootstrap_mean,
    independent_streams,
    position_sensitivity,
    run_ab,
    skewed_stream,
    sweep_levers,
)
from kvrag.cli.main import app
from kvrag.reuse.lexical import IndexedDoc, LexicalIndex
from tests.conftest import tiny
from tests.unit.test_streams import DOCS, QUESTIONS, SHORT_DOCS, SHORT_QUESTIONS

# A gold answer that tiny-random-qwen2's text sometimes holds and sometimes not, so accuracies move
QUOTE_QUESTIONS = [{**q, "answers": ["'"]} for q in SHORT_QUESTIONS]


def test_independent_streams_differ_in_seed_skew_and_phrasing_set():
    specs = independent_streams(4, n=60, seed=5)
    assert [s.seed for s in specs] == [5, 6, 7, 8]
    assert [(s.kind, s.phrasings) for s in specs] == [("zipf", "all"), ("uniform", "paraphrased"), ("zipf", "asked"),
                                                     ("zipf", "all")]
    assert specs[2].s > specs[0].s
    drawn = [s.draw(DOCS, QUESTIONS) for s in specs[:3]]
    assert len({tuple(q["question"] for q in d) for d in drawn}) == 3
    assert {q["phrasing"] for q in drawn[0]} == {0, 1, 2}
    assert {q["phrasing"] for q in drawn[1]} == {1, 2}
    assert {q["phrasing"] for q in drawn[2]} == {0}
    # a question without paraphrases is asked as written in a paraphrased stream
    lonely = [{"id": "c", "question": "How many steps?", "answers": ["212"], "doc_id": "2"}]
    assert {q["phrasing"] for q in skewed_stream(SHORT_DOCS, lonely, n=5, phrasings="paraphrased")} == {0}
    with pytest.raises(InputError):
        skewed_stream(DOCS, QUESTIONS, n=5, phrasings="some")  # type: ignore[arg-type]
    with pytest.raises(InputError):
        independent_streams(0)


def test_an_interval_resamples_whole_questions_so_repeats_widen_it():
    """Ten questions each repeated ten times carry less evidence than a hundred distinct ones with
    the same answers: resampling whole questions gives the wider interval."""
    values = [float(i % 2) for i in range(100)]
    distinct = bootstrap_mean(values, [str(i) for i in range(100)])
    repeated = bootstrap_mean([float(q % 2) for q in range(10) for _ in range(10)], [str(q) for q in range(10) for _ in range(10)])
    assert distinct.estimate == repeated.estimate == 0.5
    assert repeated.high - repeated.low > 1.5 * (distinct.high - distinct.low)
    assert bootstrap_mean(values, [str(i) for i in range(100)]) == distinct  # seeded
    assert bootstrap_mean([1.0] * 5, list("abcde")) == Interval(estimate=1.0, low=1.0, high=1.0)
    with pytest.raises(InputError):
        bootstrap_mean([1.0], [])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([-1.0, 0.0, 1.0]), st.sampled_from("abcdef")), min_size=1, max_size=40))
def test_an_interval_lies_within_the_values_and_is_ordered(rows):
    values, clusters = zip(*rows)
    interval = bootstrap_mean(values, clusters, resamples=200)
    assert min(values) <= interval.low <= interval.high <= max(values)
    assert interval.estimate == pytest.approx(statistics.fmean(values))


def test_a_lever_holds_only_where_its_accuracy_reaches_the_retrieval_orders_interval():
    def run(accuracy: float, difference_high: float = 0.1) -> LeverOnStream:
        return LeverOnStream(stream=StreamSpec(), lever="x", n=10, whole_context=0.5, whole_context_baseline=0.4,
                             token_reuse=0.6, accuracy=accuracy, accuracy_retrieval_order=Interval(estimate=0.4, low=0.3, high=0.5),
                             difference=Interval(estimate=-0.05, low=-0.1, high=difference_high), answers_changed=0,
                             reordered_rows=0, logits_byte_exact=1.0)
    assert run(0.3).holds and run(0.9).holds and not run(0.29).holds
    # within the interval of retrieval order, but paired question by question it is worse
    assert run(0.35, difference_high=0.0).holds and not run(0.35, difference_high=-0.01).holds
    assert run(0.2).model_dump()["holds"] is False  # written out with the run


def test_a_sweeps_figures_are_those_of_its_own_runs_on_each_stream():
    """Each stream's figures equal what two plain `run_ab` runs on the same stream give: the lever's
    accuracy, accuracy in retrieval order and whole-context share, and the baseline's share."""
    engine = KVEngine(tiny("qwen2"), MemoryStore())
    specs = independent_streams(2, n=5, seed=3)
    sweep = sweep_levers(engine, SHORT_DOCS, QUOTE_QUESTIONS, {"canonical": {"order": "canonical"}}, streams=specs,
                         k=3, max_new_tokens=3)
    assert [r.stream for r in sweep.runs] == specs and sweep.model == "tiny-random-qwen2"
    for spec, measured in zip(specs[:1], sweep.runs):  # one stream recomputed keeps the test short
        stream = spec.draw(SHORT_DOCS, QUOTE_QUESTIONS)
        baseline = run_ab(KVEngine(tiny("qwen2"), MemoryStore()), SHORT_DOCS, stream, k=3, max_new_tokens=3)
        lever = run_ab(KVEngine(tiny("qwen2"), MemoryStore()), SHORT_DOCS, stream, k=3, max_new_tokens=3, order="canonical")
        assert measured.whole_context_baseline == baseline.full_hit_rate
        assert measured.whole_context == lever.full_hit_rate and measured.accuracy == lever.accuracy_kv
        assert measured.accuracy_retrieval_order.estimate == pytest.approx(lever.accuracy_text_retrieval_order)
        assert measured.difference.estimate == pytest.approx(lever.accuracy_kv - lever.accuracy_text_retrieval_order)
        assert measured.answers_changed == sum(r.kv_answer != r.text_retrieval_order_answer for r in lever.rows)
        assert measured.reordered_rows == sum(r.order_changed for r in lever.rows)
    assert {r.accuracy for r in sweep.runs} | {r.accuracy_retrieval_order.estimate for r in sweep.runs} != {0.0}
    (verdict,) = sweep.verdicts
    assert verdict.rows == 10 and verdict.holds == (all(r.holds for r in sweep.runs) and verdict.difference.high >= 0)
    assert verdict.difference.estimate == pytest.approx(statistics.fmean(r.difference.estimate for r in sweep.runs))
    with pytest.raises(InputError):
        sweep_levers(engine, SHORT_DOCS, QUOTE_QUESTIONS, {BASELINE: {}}, streams=specs)


def test_position_sensitivity_moves_only_the_questions_own_document(monkeypatch):
    engine = KVEngine(tiny("qwen2"), MemoryStore())
    calls: list[tuple[str, list[str]]] = []
    generate = engine.generate

    def observed(query, **kwargs):
        calls.append((query, list(kwargs["states"])))
        assert kwargs["graft"] is False
        return generate(query, **kwargs)

    monkeypatch.setattr(engine, "generate", observed)
    measured = position_sensitivity(engine, SHORT_DOCS, QUOTE_QUESTIONS, k=3, max_new_tokens=2)
    index = LexicalIndex([IndexedDoc(d["text"], {"id": d["id"]}) for d in SHORT_DOCS])
    by_id = {d["id"]: d["text"] for d in SHORT_DOCS}
    expected = []
    for q in QUOTE_QUESTIONS:
        found = [d.text for d, _ in index.search(q["question"], 3)]
        if by_id[q["doc_id"]] in found:
            others = [t for t in found if t != by_id[q["doc_id"]]]
            expected += [(q["question"], [*others[:p], by_id[q["doc_id"]], *others[p:]]) for p in range(3)]
    assert calls == expected and measured.questions == len(expected) // 3 > 0
    assert len(measured.accuracy_by_position) == 3
    with pytest.raises(InputError):
        position_sensitivity(engine, SHORT_DOCS, QUOTE_QUESTIONS, k=1)


def test_kvrag_ab_streams_measures_the_lever_given_and_refuses_what_it_cannot(tmp_path):
    import json

    docs, questions = tmp_path / "docs.jsonl", tmp_path / "questions.jsonl"
    docs.write_text("\n".join(json.dumps(d) for d in SHORT_DOCS))
    questions.write_text("\n".join(json.dumps(q) for q in QUOTE_QUESTIONS))
    common = ["ab", "--docs", str(docs), "--questions", str(questions), "--model", "tiny-random-qwen2", "--k", "3",
              "--max-tokens", "2"]
    runner = CliRunner()
    result = runner.invoke(app, [*common, "--order", "canonical", "--streams", "2", "--stream-n", "4", "--json",
                                 "--out", str(tmp_path / "sweep.json")])
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "sweep.json").read_text())
    assert len(written["streams"]) == 2 and [v["lever"] for v in written["verdicts"]] == ["order canonical"]
    assert written["runs"][0]["stream"]["phrasings"] == "all" and written["runs"][1]["stream"]["kind"] == "uniform"
    for refused, says in ((["--streams", "2"], "name one"), (["--streams", "2", "--order", "canonical", "--store", "memory://"],
                          "fresh memory store"), (["--positions"], "--streams")):
        failed = runner.invoke(app, [*common, *refused])
        assert failed.exit_code == 2 and says in failed.output and "Traceback" not in failed.output, failed.output
