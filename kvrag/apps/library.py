"""A verified solution library: problems whose solutions passed a verifier, kept as KV states.

`add` checks each solution with a pluggable verifier (default: the solution ends in its answer),
deposits the state of [problem + solution] and memoizes the problem, so a recurring problem is
answered from its entry (receipt `memo`) and a new one is answered with the closest verified
solutions grafted ahead of it.
"""

from __future__ import annotations

import hashlib
import importlib
import re
from typing import Any, Callable, Iterable

from pydantic import BaseModel

from kvrag.core.decoding import Generation
from kvrag.engine.engine import KVEngine
from kvrag.errors import InputError
from kvrag.reuse.lexical import IndexedDoc, LexicalIndex
from kvrag.reuse.memo import Provenance

__all__ = ["LibraryEntry", "AddReport", "Library", "ends_with_answer", "load_verifier"]

Verifier = Callable[[str, str, str], bool]


def ends_with_answer(problem: str, solution: str, answer: str) -> bool:
    """The default verifier: the solution's last words are its answer (case and final punctuation aside)."""
    def norm(text: str) -> str:
        return re.sub(r"[\s\.\!]+$", "", " ".join(text.split())).casefold()

    return bool(answer.strip()) and norm(solution).endswith(norm(answer))


def load_verifier(spec: str | None) -> tuple[Verifier, str]:
    """`None` for the default, or `module:function` taking (problem, solution, answer) -> bool."""
    if not spec:
        return ends_with_answer, "kvrag.apps.library:ends_with_answer"
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name), spec
    except (ImportError, AttributeError, ValueError) as e:
        raise InputError(f"cannot load verifier {spec!r}: {e}; use module:function") from e


class LibraryEntry(BaseModel):
    id: str
    problem: str
    solution: str
    answer: str
    state_key: str
    provenance: Provenance


class AddReport(BaseModel):
    added: list[str] = []
    rejected: list[str] = []
    already: list[str] = []


def solution_document(problem: str, solution: str) -> str:
    return f"Problem: {problem}\nSolution: {solution}"


class Library:
    def __init__(self, engine: KVEngine) -> None:
        self.engine = engine

    @staticmethod
    def _name(entry_id: str) -> str:
        return f"library/{hashlib.sha256(entry_id.encode()).hexdigest()}"

    def entries(self) -> list[LibraryEntry]:
        found = []
        for name in self.engine.records.names("library"):
            raw = self.engine.records.get(name)  # sealed: a forged or edited entry is skipped
            if raw:
                try:
                    found.append(LibraryEntry.model_validate_json(raw))
                except ValueError:
                    continue
        return sorted(found, key=lambda e: e.id)

    def add(self, items: Iterable[dict[str, Any]], verifier: str | None = None, progress: Callable[[int], None] | None = None) -> AddReport:
        check, verifier_name = load_verifier(verifier)
        report = AddReport()
        for number, item in enumerate(items, 1):
            missing = [f for f in ("id", "problem", "solution", "answer") if f not in item]
            if missing:
                raise InputError(f"library line {number} lacks {', '.join(missing)}")
            entry_id = str(item["id"])
            problem, solution, answer = str(item["problem"]), str(item["solution"]), str(item["answer"])
            if not check(problem, solution, answer):
                report.rejected.append(entry_id)
                continue
            if self.engine.records.get(self._name(entry_id)):
                report.already.append(entry_id)
                continue
            provenance = Provenance(kind="checker", by=verifier_name)
            ref = self.engine.ensure(solution_document(problem, solution))
            self.engine.memo.memoize_text(problem, solution, provenance=provenance, decode_suffix=answer)
            entry = LibraryEntry(id=entry_id, problem=problem, solution=solution, answer=answer, state_key=ref.key, provenance=provenance)
            self.engine.records.put(self._name(entry_id), entry.model_dump_json().encode())
            report.added.append(entry_id)
            if progress:
                progress(number)
        return report

    def solve(self, problem: str, *, k: int = 2, max_new_tokens: int = 128) -> tuple[Generation, list[LibraryEntry]]:
        """A recurring problem comes from its memo entry; a new one gets the `k` closest verified
        solutions grafted ahead of it."""
        recurring = self.engine.generate(problem, max_new_tokens=max_new_tokens)
        if recurring.receipt.mode == "memo":
            return recurring, []
        entries = self.entries()
        if not entries:
            return recurring, []
        index = LexicalIndex([IndexedDoc(e.problem, {"i": i}) for i, e in enumerate(entries)])
        closest = [entries[d.metadata["i"]] for d, score in index.search(problem, k) if score > 0]
        documents = [solution_document(e.problem, e.solution) for e in closest]
        return self.engine.generate(problem, states=documents, max_new_tokens=max_new_tokens), closest
