"""`kvrag demo`: the main job on the embedded defaults, offline.

Loads `smollm2-135m`, deposits the bundled documents into the default disk store (verified, once),
then answers the bundled questions twice, by graft and by text re-prefill, side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvrag.data import sample_docs, sample_questions
from kvrag.engine.engine import Generation, KVEngine

__all__ = ["DemoRow", "run_demo"]


@dataclass(frozen=True)
class DemoRow:
    question: str
    graft: Generation
    text: Generation


def run_demo(
    engine: KVEngine,
    *,
    questions: int = 6,
    max_new_tokens: int = 24,
    on_step: Callable[[str], None] | None = None,
) -> list[DemoRow]:
    step = on_step or (lambda _msg: None)
    docs = {d.id: d for d in sample_docs()}
    asked = sample_questions()[:questions]
    refs = {}
    for q in asked:
        if q.doc_id and q.doc_id not in refs:
            step(f"depositing {docs[q.doc_id].title!r} into {engine.store.url}")
            refs[q.doc_id] = engine.deposit(docs[q.doc_id].text)
    rows = []
    for q in asked:
        step(f"asking {q.question!r}")
        states = [refs[q.doc_id]] if q.doc_id else []
        graft = engine.generate(q.question, states=states, max_new_tokens=max_new_tokens)
        text = engine.generate(q.question, states=states, max_new_tokens=max_new_tokens, graft=False)
        rows.append(DemoRow(q.question, graft, text))
    return rows
