"""Question streams for `kvrag ab`: traffic that repeats itself the way real traffic does.

A skewed stream draws each question in three steps: a document by its popularity (Zipf: the
document of rank r is drawn with weight 1/r^s, ranks a seeded shuffle of the documents; s = 0 is
uniform), one of that document's questions, and one of that question's phrasings (the question or
one of its `paraphrases`), both uniformly. The same seed always gives the same stream.

`phrasings` picks the phrasing set: `all`, `asked` (the questions as written) or `paraphrased`
(their paraphrases only; a question without paraphrases is asked as written), so that streams can
differ in wording as well as in which questions they draw.
"""

from __future__ import annotations

import random
from typing import Any, Literal, Sequence

from kvrag.errors import InputError

__all__ = ["Stream", "Phrasings", "skewed_stream", "ZIPF_S"]

#: `uniform` (every document equally popular) or `zipf` (popularity 1/rank^s)
Stream = Literal["uniform", "zipf"]
#: which phrasings of a question a stream draws from
Phrasings = Literal["all", "asked", "paraphrased"]
ZIPF_S = 1.1


def skewed_stream(docs: Sequence[dict[str, Any]], questions: Sequence[dict[str, Any]], *, n: int,
                  stream: Stream = "zipf", s: float = ZIPF_S, seed: int = 0,
                  phrasings: Phrasings = "all") -> list[dict[str, Any]]:
    """`n` questions drawn as the module docstring says. Each keeps its `answers` and `doc_id`; its
    `id` is `<question id>@<position>`, `base_id` the question's own id, `phrasing` which phrasing
    (0: the question itself), and `recurring` whether the same phrasing came earlier in the stream.
    Questions marked `recurring` in `questions` (variants of others) are not drawn."""
    if n < 1:
        raise InputError("a question stream needs at least one question")
    if stream not in ("uniform", "zipf") or not 0 <= s <= 10:
        raise InputError("a stream is uniform or zipf, with 0 <= s <= 10")
    if phrasings not in ("all", "asked", "paraphrased"):
        raise InputError("a stream's phrasings are all, asked or paraphrased")
    doc_ids = [str(d["id"]) for d in docs]
    by_doc: dict[str, list[dict[str, Any]]] = {}
    for q in questions:
        if not q.get("recurring") and str(q.get("doc_id")) in doc_ids:
            by_doc.setdefault(str(q["doc_id"]), []).append(q)
    if not by_doc:
        raise InputError("a skewed stream draws questions by their document: give questions a doc_id that names a document")
    rng = random.Random(seed)
    ranked = [d for d in doc_ids if d in by_doc]
    rng.shuffle(ranked)
    weights = [1.0 / (rank + 1) ** (s if stream == "zipf" else 0.0) for rank in range(len(ranked))]
    drawn, seen = [], set()
    for position in range(n):
        question = rng.choice(by_doc[rng.choices(ranked, weights)[0]])
        wordings = [str(question["question"]), *(str(p) for p in question.get("paraphrases", ()))]
        allowed = {"all": range(len(wordings)), "asked": range(1),
                   "paraphrased": range(1, len(wordings)) if len(wordings) > 1 else range(1)}[phrasings]
        phrasing = allowed[rng.randrange(len(allowed))]
        base = str(question["id"])
        drawn.append({
            **{k: v for k, v in question.items() if k != "paraphrases"},
            "id": f"{base}@{position}", "question": wordings[phrasing], "base_id": base, "phrasing": phrasing,
            "recurring": (base, phrasing) in seen,
        })
        seen.add((base, phrasing))
    return drawn
