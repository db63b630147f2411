"""The bundled sample set: short fictional documents (so answers come only from them) and questions."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

__all__ = ["SampleDoc", "SampleQuestion", "sample_docs", "sample_questions", "sample_paths", "verification_pairs", "long_document"]


@dataclass(frozen=True)
class SampleDoc:
    id: str
    title: str
    text: str


@dataclass(frozen=True)
class SampleQuestion:
    id: str
    question: str
    answers: tuple[str, ...]
    doc_id: str | None = None
    recurring: bool = False
    #: the same question in other words (for skewed question streams: `kvrag.apps.ab.streams`)
    paraphrases: tuple[str, ...] = ()


def _jsonl(name: str) -> list[dict[str, Any]]:
    text = resources.files("kvrag.data").joinpath(name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def sample_docs() -> list[SampleDoc]:
    return [SampleDoc(d["id"], d["title"], d["text"]) for d in _jsonl("docs.jsonl")]


def sample_questions(*, include_recurring: bool = False) -> list[SampleQuestion]:
    """The bundled questions; the `recurring` variants (same question, other case or punctuation)
    exist for memo checks in `kvrag ab` and are left out unless asked for."""
    questions = [
        SampleQuestion(q["id"], q["question"], tuple(q["answers"]), q.get("doc_id"), bool(q.get("recurring")),
                       tuple(q.get("paraphrases", ())))
        for q in _jsonl("questions.jsonl")
    ]
    return [q for q in questions if include_recurring or not q.recurring]


def sample_paths() -> tuple[str, str]:
    """File paths of the bundled DOCS and QUESTIONS JSONL files (the `kvrag ab` defaults)."""
    folder = resources.files("kvrag.data")
    return str(folder.joinpath("docs.jsonl")), str(folder.joinpath("questions.jsonl"))


def verification_pairs(count: int, tokenizer: Any = None, max_doc_tokens: int = 1024) -> list[tuple[str, str]]:
    """`count` (document, question) pairs of varied lengths: one sentence up to three documents.

    Lengths cycle through five sizes so that every run includes documents shorter and longer than
    a small sliding window, and the same `count` always gives the same pairs. With a `tokenizer`,
    documents are cut at a sentence boundary to at most `max_doc_tokens` tokens, which keeps a
    byte-level tokenizer's prompts (one token per byte) about as long as a BPE tokenizer's.
    """
    docs = sample_docs()
    by_id = {d.id: i for i, d in enumerate(docs)}
    questions = sample_questions()
    pairs = []
    for n in range(count):
        q = questions[n % len(questions)]
        first = by_id.get(q.doc_id or "", n % len(docs))
        size = n % 5
        text = docs[first].text
        if size == 0:
            text = text.split(". ")[0] + "."
        elif size == 1:
            text = ". ".join(text.split(". ")[:3]) + "."
        elif size >= 3:
            extra = size - 2
            text = "\n".join([text] + [docs[(first + k) % len(docs)].text for k in range(1, extra + 1)])
        if tokenizer is not None:
            text = _cut_to_tokens(tokenizer, text, max_doc_tokens)
        pairs.append((text, q.question))
    return pairs


def _cut_to_tokens(tokenizer: Any, text: str, limit: int) -> str:
    while len(tokenizer(text, add_special_tokens=False)["input_ids"]) > limit and ". " in text:
        text = text.rsplit(". ", 1)[0] + "."
    return text


def long_document(tokenizer: Any, tokens: int) -> str:
    """A document of about `tokens` tokens for `tokenizer`, made by cycling the bundled documents."""
    docs = sample_docs()
    parts: list[str] = []
    count = 0
    i = 0
    while count < tokens:
        for sentence in docs[i % len(docs)].text.split(". "):
            piece = sentence if sentence.endswith(".") else sentence + "."
            n = len(tokenizer(" " + piece, add_special_tokens=False)["input_ids"])
            if count + n > tokens and parts:
                return " ".join(parts)
            parts.append(piece)
            count += n
        i += 1
    return " ".join(parts)
