"""The A/B harness, the solution library and their CLI commands (tiny model for speed)."""

from __future__ import annotations

import json
import statistics

import pytest
from typer.testing import CliRunner

from kvrag import InputError, KVEngine, MemoryStore
from kvrag.apps.ab import ABSummary, load_jsonl, run_ab, write_report
from kvrag.apps.library import Library, ends_with_answer, load_verifier
from kvrag.cli import app
from kvrag.data import sample_docs

from ..conftest import tiny

DOCS = [{"id": d.id, "title": d.title, "text": d.text[:300]} for d in sample_docs()[:4]]
# Real gold answers for the real model: "a" is answered right; "b"'s gold is one no answer contains.
QUESTIONS = [
    {"id": "a", "question": "Who built the lighthouse at Varrow Point?", "answers": ["Mara Quill"]},
    {"id": "b", "question": "When was the Kelpfield Cooperative founded?", "answers": ["no such year"]},
    {"id": "a2", "question": "who built the LIGHTHOUSE at varrow point", "answers": ["Mara Quill"], "recurring": True},
    {"id": "b2", "question": "when was the kelpfield cooperative founded", "answers": ["no such year"], "recurring": True},
]


@pytest.mark.slow
def test_ab_arms_agree_and_only_verified_answers_are_memoized(tmp_path, smollm2):
    engine = KVEngine(smollm2, MemoryStore())
    summary = run_ab(engine, DOCS, QUESTIONS, k=2, max_new_tokens=20, policy="warm")
    rows = {r.id: r for r in summary.rows}
    assert summary.n == 4 and summary.exact_rows == 3
    assert summary.answer_agreement == 1.0 and summary.logits_byte_exact_rate == 1.0
    assert rows["a"].kv_hit and "Mara Quill" in rows["a"].kv_answer and not rows["b"].kv_hit
    assert summary.accuracy_text == summary.accuracy_kv == 0.5
    assert rows["a"].memoized and not rows["b"].memoized  # a wrong answer is never memoized
    assert rows["a2"].kv_mode == "memo" and rows["a2"].decode_tokens_kv <= 8 and rows["a2"].kv_answer == rows["a"].kv_answer
    assert rows["b2"].kv_mode != "memo"
    # a memo row has no first-token logits of the question: not measured, never a made-up 0 / True
    assert rows["a2"].kl_vs_text is None and rows["a2"].first_token_agrees is None
    assert rows["a"].kl_vs_text == 0.0 and rows["a"].first_token_agrees is True
    assert summary.memo_hits == 1 and summary.prefill_tokens_kv < summary.prefill_tokens_text
    assert all(r.kv_mode in ("exact-graft", "memo") for r in summary.rows)  # warm: every chain stored first
    assert summary.mode_mix == {"exact-graft": 3, "memo": 1} and summary.policy == "warm"
    report = write_report(summary, tmp_path / "report")
    assert report.exists() and {p.name for p in (tmp_path / "report").glob("*.png")} == {
        "ttft_by_length.png", "prefill_tokens.png", "agreement.png"}
    # The summary's figures are the rows' figures, and they survive a JSON round trip into the report.
    assert summary.prefill_tokens_kv == sum(r.prefill_tokens_kv for r in summary.rows)
    assert summary.ttft_ratio_median == statistics.median(r.ttft_text_ms / r.ttft_kv_ms for r in summary.rows)
    assert summary.total_kv_ms_median == statistics.median(r.total_kv_ms for r in summary.rows)
    decoded = [r.per_token_text_ms for r in summary.rows if r.decode_tokens_text > 1]
    assert decoded and summary.per_token_text_ms_median == statistics.median(decoded)
    assert all(r.ttft_kv_ms < r.total_kv_ms and r.ttft_text_ms < r.total_text_ms for r in summary.rows)
    assert ABSummary.model_validate_json(summary.model_dump_json()) == summary
    text = report.read_text()
    assert f"{summary.ttft_ratio_median:.1f}x" in text and rows["a"].kv_answer.split()[0] in text
    assert f"{summary.per_token_kv_ms_median:.1f} ms" in text and f"{summary.total_text_ms_median:.0f} ms" in text


def test_ab_cli_writes_json_and_report(tmp_path):
    docs, questions = tmp_path / "docs.jsonl", tmp_path / "questions.jsonl"
    docs.write_text("\n".join(json.dumps(d) for d in DOCS))
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS[:2]))
    result = CliRunner().invoke(app, ["ab", "--docs", str(docs), "--questions", str(questions), "--model", "tiny-random-qwen2",
                                      "--store", "memory://", "--max-tokens", "6", "--out", str(tmp_path / "ab.json"),
                                      "--report", str(tmp_path / "report"), "--k", "2", "--order", "stored-first"])
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "ab.json").read_text())
    assert written["n"] == 2 and written["policy"] == "lazy" and written["levers"] == ["stored-first"]
    assert sum(written["mode_mix"].values()) == 2 and "mode_mix" in result.output
    assert (tmp_path / "report" / "report.md").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    failed = CliRunner().invoke(app, ["ab", "--docs", str(bad), "--model", "tiny-random-qwen2"])
    assert failed.exit_code == 2 and "lacks" in failed.output and "Traceback" not in failed.output


PROBLEMS = [
    {"id": "p1", "problem": "A baker makes 12 loaves an hour for 7 hours. How many loaves?", "solution": "12 times 7 is 84. The answer is 84", "answer": "84"},
    {"id": "p2", "problem": "A rope of 45 metres is cut into 3 metre pieces. How many pieces?", "solution": "45 divided by 3 is 15. The answer is 15.", "answer": "15"},
    {"id": "bad", "problem": "What is 7 times 8?", "solution": "7 times 8 is 54. The answer is 54", "answer": "56"},
]


def test_library_verifies_deposits_and_answers_recurring_problems_from_memo():
    engine = KVEngine(tiny("llama"), MemoryStore())
    library = Library(engine)
    report = library.add(PROBLEMS)
    assert report.added == ["p1", "p2"] and report.rejected == ["bad"]
    assert library.add(PROBLEMS[:1]).already == ["p1"]
    recurring, used = library.solve("a baker makes 12 loaves an hour for 7 hours. how many loaves")
    assert recurring.receipt.mode == "memo" and recurring.receipt.decode_tokens <= 8 and not used
    assert recurring.text == PROBLEMS[0]["solution"]
    new, used = library.solve("A baker makes 9 loaves an hour for 3 hours. How many loaves?", k=1, max_new_tokens=4)
    assert new.receipt.mode == "exact-graft" and [e.id for e in used] == ["p1"]
    assert {e.provenance.by for e in library.entries()} == {"kvrag.apps.library:ends_with_answer"}


def test_verifiers():
    assert ends_with_answer("", "so it is 84.", "84") and not ends_with_answer("", "84 is wrong", "84")
    assert load_verifier("kvrag.apps.library:ends_with_answer")[0] is ends_with_answer
    with pytest.raises(InputError):
        load_verifier("no.such.module:check")


def test_library_cli(tmp_path):
    file = tmp_path / "problems.jsonl"
    file.write_text("\n".join(json.dumps(p) for p in PROBLEMS))
    common = ["--model", "tiny-random-llama", "--store", f"disk://{tmp_path / 'states'}"]
    added = CliRunner().invoke(app, ["library", "add", str(file), *common, "--json"])
    assert added.exit_code == 0, added.output
    assert json.loads(added.stdout)["rejected"] == ["bad"]
    solved = CliRunner().invoke(app, ["library", "solve", PROBLEMS[1]["problem"], *common, "--json"])
    assert solved.exit_code == 0 and json.loads(solved.stdout)["receipt"]["mode"] == "memo"


def test_load_jsonl_errors(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("not json\n")
    with pytest.raises(InputError, match="not JSON"):
        load_jsonl(path, ["id"])
    with pytest.raises(InputError):
        load_jsonl(tmp_path / "missing.jsonl", ["id"])
