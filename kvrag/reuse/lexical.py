"""A small lexical index for kvrag's own retrievers: TF-IDF cosine over words, no model needed.

Real deployments wrap their own retriever or vector store; this index makes the adapters usable
(and testable) offline on small in-memory corpora.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["IndexedDoc", "LexicalIndex"]

_WORD = re.compile(r"\w+", re.UNICODE)


def _terms(text: str) -> list[str]:
    return [w.casefold() for w in _WORD.findall(text)]


@dataclass(frozen=True)
class IndexedDoc:
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    id: str | None = None


class LexicalIndex:
    def __init__(self, docs: Sequence[IndexedDoc | str]) -> None:
        self.docs = [d if isinstance(d, IndexedDoc) else IndexedDoc(d) for d in docs]
        counts = [Counter(_terms(d.text)) for d in self.docs]
        df = Counter(t for c in counts for t in c)
        n = len(self.docs)
        self._idf = {t: math.log((1 + n) / (1 + f)) + 1 for t, f in df.items()}
        self._vectors = [self._vector(c) for c in counts]

    def _vector(self, counts: Counter[str]) -> dict[str, float]:
        v = {t: (1 + math.log(c)) * self._idf.get(t, 0.0) for t, c in counts.items()}
        norm = math.sqrt(sum(x * x for x in v.values())) or 1.0
        return {t: x / norm for t, x in v.items()}

    def similarity(self, i: int, j: int) -> float:
        """The cosine similarity of documents `i` and `j` (their positions in the index)."""
        a, b = self._vectors[i], self._vectors[j]
        return sum(x * b.get(t, 0.0) for t, x in a.items())

    def search(self, query: str, k: int) -> list[tuple[IndexedDoc, float]]:
        """The `k` best documents by cosine similarity, best first; ties keep corpus order."""
        q = self._vector(Counter(_terms(query)))
        scored = [(sum(q.get(t, 0.0) * x for t, x in v.items()), i) for i, v in enumerate(self._vectors)]
        scored.sort(key=lambda s: (-s[0], s[1]))
        return [(self.docs[i], score) for score, i in scored[: max(0, k)]]
