"""Chapters (`kvrag.reuse.chapters`): a corpus cut into chains of at most N tokens by the
retriever's similarity; a question reads the chapter holding most of its top k, grafted whole and
exactly, then the documents outside it as text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrag import ContextTooLongError, KVEngine, MemoryStore
from kvrag.reuse.chapters import Chapters, cut_chapters
from kvrag.reuse.lexical import LexicalIndex
from tests.conftest import DOC_A, DOC_B, DOC_C, QUESTION, tiny

DOC_D = "The Varrow Point ferry was replaced by a bridge in 1999; the old pier is now a fishing spot."


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), max_size=30), limit=st.integers(1, 120), seed=st.integers(0, 9))
def test_every_document_is_in_one_chapter_that_fits_unless_it_is_larger_alone(sizes, limit, seed):
    def similarity(i: int, j: int) -> float:
        return ((i * 31 + j * 17 + seed) % 7) / 7 if i != j else 1.0

    chapters = cut_chapters(sizes, limit, similarity)
    assert sorted(i for chapter in chapters for i in chapter) == list(range(len(sizes)))
    for chapter in chapters:
        assert chapter == sorted(chapter)
        assert sum(sizes[i] for i in chapter) <= limit or len(chapter) == 1
    assert chapters == cut_chapters(sizes, limit, similarity)


def test_alike_documents_share_a_chapter():
    docs = [DOC_A, DOC_D, DOC_B, "The ferry to Varrow Point leaves twice a day; the ferry pier is old."]
    index = LexicalIndex(docs)
    sizes = [10, 10, 10, 10]
    assert cut_chapters(sizes, 20, index.similarity) == [[0, 2], [1, 3]]


@pytest.fixture(scope="module")
def engine() -> KVEngine:
    return KVEngine(tiny("llama"), MemoryStore())


def test_a_question_grafts_its_chapter_whole_and_reads_the_rest_as_text_exactly(engine):
    corpus = [DOC_A, DOC_D, DOC_B, DOC_C]
    sizes = [len(engine.tokenize(t)) for t in corpus]
    book = Chapters(engine, corpus, max_tokens=sizes[0] + sizes[2] + sizes[3], similarity=LexicalIndex(corpus).similarity)
    assert len(book.chapters) >= 2 and sorted(t for c in book.chapters for t in c) == sorted(corpus)
    chapter = next(c for c in book.chapters if DOC_B in c)
    outside = next(t for t in corpus if t not in chapter)
    read = book.route([DOC_B, outside, *(t for t in chapter if t != DOC_B)][:3])
    assert read[: len(chapter)] == chapter and read[len(chapter):] == [outside]
    kv = engine.generate(QUESTION, states=read, max_new_tokens=3, memo=False)
    text = engine.generate(QUESTION, states=read, max_new_tokens=3, graft=False)
    assert [u.source for u in kv.receipt.states] == ["graft"] * len(chapter) + ["text"]
    assert kv.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256
    assert book.route(["a text from elsewhere"]) == ["a text from elsewhere"]


def test_chapters_that_leave_no_room_are_refused(engine):
    with pytest.raises(ContextTooLongError, match="smaller chapters"):
        Chapters(engine, [DOC_A], max_tokens=engine.model.max_positions, similarity=lambda i, j: 0.0)


def test_kvrag_ab_with_chapters_is_exact_and_reports_accuracy_in_retrieval_order():
    from kvrag.apps.ab import load_jsonl, run_ab
    from kvrag.data import sample_paths

    docs_path, questions_path = sample_paths()
    docs = load_jsonl(docs_path, ["id", "title", "text"])
    questions = load_jsonl(questions_path, ["id", "question", "answers"])[:2]
    engine = KVEngine(tiny("llama"), MemoryStore())
    summary = run_ab(engine, docs, questions, k=3, max_new_tokens=2, chapters=600, stock=False)
    assert summary.levers == ["chapters of 600 tokens"]
    assert summary.logits_byte_exact_rate == 1.0 and summary.monolithic_byte_exact_rate == 1.0
    assert all(r.kv_mode in ("exact-graft", "partial-graft", "memo") for r in summary.rows)
    assert any(r.tokens_reused_kv > 0 for r in summary.rows)
    assert 0.0 <= summary.accuracy_text_retrieval_order <= 1.0
