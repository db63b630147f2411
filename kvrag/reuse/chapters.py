"""Chapters: a corpus larger than one context, cut into context-sized chains a question grafts whole.

A corpus chain (`kvrag.reuse.levers.CorpusChain`) makes every question an exact graft, but only for
a corpus that fits one context, and every question then reads all of it. Chapters cut the corpus
into chapters of at most `max_tokens`, grouping documents the retriever finds alike (its own
similarity), and deposit each chapter once as a chain. A question is routed to the chapter that
holds most of its top-k documents: that chapter is grafted whole, exactly, and the top-k documents
outside it follow as text, in retrieval order. The prompt changes (the chapter's other documents
are read too, and the order is the chapter's), so this is opt-in and its accuracy is measured
against text RAG in retrieval order (`kvrag ab --chapters N`).
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvrag.core.protocol import Engine
from kvrag.errors import ContextTooLongError, InputError

__all__ = ["Chapters", "cut_chapters", "MIN_ROOM"]

#: positions a chapter leaves at least for the documents outside it, the question and the answer
MIN_ROOM = 256


def cut_chapters(sizes: Sequence[int], max_tokens: int, similarity: Callable[[int, int], float]) -> list[list[int]]:
    """Documents (by their token counts `sizes`) grouped into chapters of at most `max_tokens`:
    each chapter starts at the first document left and takes, one at a time, the document left that
    is most alike to its members on average (ties: the earliest), while it fits. A document larger
    than `max_tokens` is a chapter of its own. Each chapter lists its documents in corpus order."""
    left = list(range(len(sizes)))
    chapters: list[list[int]] = []
    while left:
        chapter, used = [left.pop(0)], 0
        used = sizes[chapter[0]]
        while True:
            fitting = [i for i in left if used + sizes[i] <= max_tokens]
            if not fitting:
                break
            best = max(fitting, key=lambda i: (sum(similarity(i, j) for j in chapter) / len(chapter), -i))
            chapter.append(best)
            left.remove(best)
            used += sizes[best]
        chapters.append(sorted(chapter))
    return chapters


class Chapters:
    """The corpus `texts` cut into chapters (`cut_chapters`), each deposited as a chain now."""

    def __init__(self, engine: Engine, texts: Sequence[str], *, max_tokens: int,
                 similarity: Callable[[int, int], float]) -> None:
        if max_tokens + MIN_ROOM > engine.model.max_positions:
            raise ContextTooLongError(
                f"chapters of {max_tokens} tokens leave fewer than {MIN_ROOM} of {engine.model.max_positions} positions "
                "for the other documents, the question and the answer; use smaller chapters")
        if max_tokens < 1:
            raise InputError("max_tokens is a positive number of tokens")
        self.texts = list(texts)
        sizes = [len(engine.tokenize(t)) for t in self.texts]
        self.chapters = [[self.texts[i] for i in chapter] for chapter in cut_chapters(sizes, max_tokens, similarity)]
        self._chapter_of = {text: n for n, chapter in enumerate(self.chapters) for text in chapter}
        for chapter in self.chapters:
            engine.deposit_chain(chapter)

    def route(self, retrieved: Sequence[str]) -> list[str]:
        """What a question with these top-k documents reads: the chapter holding most of them
        (ties: the one holding the best-ranked), then those outside it, in retrieval order. A
        document not in the corpus is read after the chapter, as the others outside it are."""
        votes: dict[int, int] = {}
        for text in retrieved:
            if text in self._chapter_of:
                votes[self._chapter_of[text]] = votes.get(self._chapter_of[text], 0) + 1
        if not votes:
            return list(retrieved)
        first = {n: min(i for i, t in enumerate(retrieved) if self._chapter_of.get(t) == n) for n in votes}
        best = max(votes, key=lambda n: (votes[n], -first[n]))
        chapter = self.chapters[best]
        return [*chapter, *(t for t in retrieved if t not in chapter)]
