"""The glossary covers every term the docs define: a lowercase bold phrase on any page (the docs'
way of introducing a term) is one of the glossary's bold words, so a reader who meets a term before
its page defines it can look it up. The closed sets the glossary lists are the code's."""

from __future__ import annotations

import re
from pathlib import Path

from kvrag.core.receipt import REASONS

ROOT = Path(__file__).parents[2]
GLOSSARY = ROOT / "docs" / "concepts" / "glossary.md"
#: benchmark pages bold their figures and columns, not terms
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p != GLOSSARY and "benchmarks" not in p.parts)]
BOLD = re.compile(r"\*\*([^*\n]+)\*\*")


def terms(text: str) -> set[str]:
    """The bold phrases of `text` that name a term: lowercase, no code, not a sentence."""
    return {t for t in BOLD.findall(text) if t[0].islower() and "`" not in t and not t.endswith((".", ":"))}


def defined(glossary: str) -> set[str]:
    return {t.lower() for t in BOLD.findall(glossary)}


def covered(term: str, words: set[str]) -> bool:
    """The term, or its stem (plural, past tense), is a glossary word."""
    stems = {term, term.removesuffix("s"), term.removesuffix("ed"), term.removesuffix("d")}
    return bool(stems & words)


def uncovered(pages: dict[str, str], glossary: str) -> dict[str, list[str]]:
    words = defined(glossary)
    found = {name: sorted(t for t in terms(text) if not covered(t, words)) for name, text in pages.items()}
    return {name: missing for name, missing in found.items() if missing}


def test_every_term_the_docs_define_is_in_the_glossary():
    pages = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in PAGES}
    assert sum(len(terms(t)) for t in pages.values()) > 15
    assert uncovered(pages, GLOSSARY.read_text(encoding="utf-8")) == {}


def test_the_glossary_lists_every_reason_a_receipt_gives():
    row = next(line for line in GLOSSARY.read_text(encoding="utf-8").splitlines() if line.startswith("| **reason**"))
    assert set(BOLD.findall(row)) - {"reason"} == set(REASONS)


def test_a_planted_undefined_term_is_found():
    glossary = "| **state** | ... |\n| **graft** | ... |\n"
    pages = {"a.md": "A **state** is **grafted**; its **shadow key** is new. **Which lever.** **Redis**"}
    assert uncovered(pages, glossary) == {"a.md": ["shadow key"]}
