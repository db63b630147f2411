"""A lever measured on several independent streams, not one: what it buys and what it costs, with
the spread a single stream hides.

Each stream is drawn from the same documents and questions with its own seed, skew and phrasing set
(`independent_streams`). On each, `run_ab` runs twice on a fresh memory store: once with no lever
(the retrieval order, the baseline) and once with the lever. What the lever buys is its share of
questions grafting their whole context against the baseline's; what it costs is accuracy against
text RAG in retrieval order, paired row by row within the lever's own run (both answers to the same
question), with a 95% interval from a bootstrap over questions: every drawn phrasing of one base
question resamples together, because a stream repeats questions and repeats are not independent.

A lever *holds* on a stream when its accuracy is at least the lower end of the retrieval order's
interval there and the interval of its paired difference reaches zero (the streams cannot tell it
from retrieval order); `LeverVerdict.holds` says whether it held on every stream and on all of them
pooled, where the paired interval is narrowest.

`position_sensitivity` measures the suspect behind an order's cost directly: each question's own
document read first, in the middle, last, the other retrieved documents in retrieval order.
"""

from __future__ import annotations

import random
import statistics
from typing import Any, Callable, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, computed_field

from kvrag.apps.ab.results import ABSummary, contains_gold
from kvrag.apps.ab.run import corpus_index, run_ab
from kvrag.apps.ab.streams import ZIPF_S, Phrasings, Stream, skewed_stream
from kvrag.core.options import GenerationOptions
from kvrag.engine.engine import KVEngine
from kvrag.errors import InputError
from kvrag.stores import MemoryStore

__all__ = ["StreamSpec", "Interval", "Spread", "LeverOnStream", "LeverVerdict", "LeverSweep", "PositionSensitivity",
           "independent_streams", "sweep_levers", "position_sensitivity", "bootstrap_mean", "BASELINE"]

#: the name of the run without a lever
BASELINE = "retrieval order"
#: bootstrap resamples behind every interval (seeded: the same rows, the same interval)
RESAMPLES = 2000


class StreamSpec(BaseModel):
    """One drawn stream (`skewed_stream`'s arguments)."""

    model_config = ConfigDict(frozen=True)
    kind: Stream = "zipf"
    s: float = ZIPF_S
    seed: int = 0
    n: int = 80
    phrasings: Phrasings = "all"

    @property
    def label(self) -> str:
        skew = f"zipf s={self.s:g}" if self.kind == "zipf" else "uniform"
        return f"{skew}, seed {self.seed}, {self.phrasings} phrasings, {self.n} questions"

    def draw(self, docs: Sequence[dict[str, Any]], questions: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        return skewed_stream(docs, questions, n=self.n, stream=self.kind, s=self.s, seed=self.seed,
                             phrasings=self.phrasings)


def independent_streams(count: int, *, n: int = 80, seed: int = 0, s: float = ZIPF_S) -> list[StreamSpec]:
    """`count` streams that differ in seed, skew and phrasing set, in turn: Zipf `s` in every
    phrasing, uniform in paraphrases only, Zipf `1.5 s` in the questions as written, then again
    with the next seeds."""
    if not 1 <= count <= 100:
        raise InputError("draw between 1 and 100 streams")
    shapes: list[tuple[Stream, float, Phrasings]] = [("zipf", s, "all"), ("uniform", 0.0, "paraphrased"),
                                                    ("zipf", 1.5 * s, "asked")]
    return [StreamSpec(kind=shapes[i % 3][0], s=shapes[i % 3][1], phrasings=shapes[i % 3][2], seed=seed + i, n=n)
            for i in range(count)]


class Interval(BaseModel):
    """An estimate and its 95% bootstrap interval."""

    estimate: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.estimate:+.2f} [{self.low:+.2f}, {self.high:+.2f}]"


class Spread(BaseModel):
    """A figure's mean over streams, and its smallest and largest value."""

    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        return cls(mean=statistics.fmean(values), low=min(values), high=max(values))


def bootstrap_mean(values: Sequence[float], clusters: Sequence[str], *, resamples: int = RESAMPLES,
                   seed: int = 0) -> Interval:
    """The mean of `values` and its 95% interval, resampling whole clusters (rows of one base
    question) with replacement. Seeded, so the same rows always give the same interval."""
    if not values or len(values) != len(clusters):
        raise InputError("a bootstrap needs one cluster name per value, and at least one value")
    groups: dict[str, list[float]] = {}
    for value, cluster in zip(values, clusters):
        groups.setdefault(cluster, []).append(value)
    sums = [(sum(g), len(g)) for g in groups.values()]
    rng = random.Random(seed)
    means = []
    for _ in range(resamples):
        drawn = [sums[rng.randrange(len(sums))] for _ in sums]
        means.append(sum(t for t, _ in drawn) / sum(c for _, c in drawn))
    means.sort()
    return Interval(estimate=statistics.fmean(values), low=means[int(0.025 * (resamples - 1))],
                    high=means[int(0.975 * (resamples - 1))])


class LeverOnStream(BaseModel):
    """One lever's run on one stream, beside the baseline run on the same stream."""

    stream: StreamSpec
    lever: str
    n: int
    whole_context: float  # questions grafting their whole context (exact-graft or memo)
    whole_context_baseline: float  # the same, with no lever, on the same stream
    token_reuse: float
    accuracy: float  # the lever's KV arm: what a user of the lever gets
    accuracy_retrieval_order: Interval  # text RAG over the same top k, in retrieval order
    difference: Interval  # accuracy minus accuracy in retrieval order, row by row
    answers_changed: int  # rows whose answer differs from text RAG's in retrieval order
    reordered_rows: int
    logits_byte_exact: float  # exact KV rows whose first-token logits equal their text arm's

    @computed_field  # type: ignore[prop-decorator]
    @property
    def holds(self) -> bool:
        """The lever's accuracy is within (or above) the retrieval order's interval, and its paired
        difference is not below zero with 95% confidence."""
        return self.accuracy >= self.accuracy_retrieval_order.low and self.difference.high >= 0


class LeverVerdict(BaseModel):
    """One lever over every stream."""

    lever: str
    streams: int
    rows: int
    whole_context: Spread
    whole_context_baseline: Spread
    difference: Interval  # pooled over streams, resampling (stream, base question) clusters
    answers_changed: int
    holds: bool  # held on every stream, and the pooled difference's interval reaches zero


class PositionSensitivity(BaseModel):
    """Text RAG accuracy with each question's own document read at each position of k."""

    k: int
    questions: int  # questions whose own document was among their top k
    accuracy_by_position: list[Interval]


class LeverSweep(BaseModel):
    model: str
    k: int
    max_new_tokens: int
    streams: list[StreamSpec]
    runs: list[LeverOnStream]
    verdicts: list[LeverVerdict]
    positions: PositionSensitivity | None = None


def _cluster(row_id: str, base_id: Any, stream: int) -> str:
    return f"{stream}/{base_id if base_id is not None else row_id}"


def sweep_levers(
    engine: KVEngine,
    docs: Sequence[dict[str, Any]],
    questions: Sequence[dict[str, Any]],
    levers: Mapping[str, Mapping[str, Any]],
    *,
    streams: Sequence[StreamSpec],
    k: int = 3,
    max_new_tokens: int = 24,
    positions: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> LeverSweep:
    """Every lever of `levers` (name -> `run_ab` options, e.g. `{"canonical order": {"order":
    "canonical"}}`) and the baseline on every stream of `streams`, each run on a fresh memory store
    with `engine`'s model and settings (`policy` lazy unless a lever says otherwise). `progress` is
    called with (run label, questions done, questions in the stream)."""
    if not streams or not levers:
        raise InputError("a lever sweep needs at least one stream and one lever")
    if BASELINE in levers:
        raise InputError(f"{BASELINE!r} is the baseline every lever is measured against; name the levers otherwise")
    runs: list[LeverOnStream] = []
    clusters: dict[str, list[tuple[float, str]]] = {name: [] for name in levers}
    for number, spec in enumerate(streams):
        stream = spec.draw(docs, questions)

        def run(name: str, options: Mapping[str, Any]) -> ABSummary:
            report = None if progress is None else (lambda done, total: progress(f"{spec.label}: {name}", done, total))
            return run_ab(engine.with_store(MemoryStore()), docs, stream, k=k, max_new_tokens=max_new_tokens,
                          stock=False, progress=report, **{"policy": "lazy", **options})

        baseline = run(BASELINE, {})
        for name, options in levers.items():
            summary = run(name, options)
            differences = [float(r.kv_hit) - float(r.text_retrieval_order_hit) for r in summary.rows]
            names = [_cluster(r.id, q.get("base_id"), number) for r, q in zip(summary.rows, stream)]
            clusters[name] += list(zip(differences, names))
            runs.append(LeverOnStream(
                stream=spec, lever=name, n=summary.n, whole_context=summary.full_hit_rate,
                whole_context_baseline=baseline.full_hit_rate, token_reuse=summary.token_reuse_rate,
                accuracy=summary.accuracy_kv,
                accuracy_retrieval_order=bootstrap_mean([float(r.text_retrieval_order_hit) for r in summary.rows], names),
                difference=bootstrap_mean(differences, names),
                answers_changed=sum(r.kv_answer != r.text_retrieval_order_answer for r in summary.rows),
                reordered_rows=sum(r.order_changed for r in summary.rows),
                logits_byte_exact=summary.logits_byte_exact_rate))
    verdicts = []
    for name in levers:
        mine = [r for r in runs if r.lever == name]
        values, names = zip(*clusters[name])
        verdicts.append(LeverVerdict(
            lever=name, streams=len(mine), rows=sum(r.n for r in mine),
            whole_context=Spread.of([r.whole_context for r in mine]),
            whole_context_baseline=Spread.of([r.whole_context_baseline for r in mine]),
            difference=(pooled := bootstrap_mean(values, names)), answers_changed=sum(r.answers_changed for r in mine),
            holds=all(r.holds for r in mine) and pooled.high >= 0))
    measured = position_sensitivity(engine, docs, questions, k=k, max_new_tokens=max_new_tokens) if positions else None
    return LeverSweep(model=engine.model.name, k=k, max_new_tokens=max_new_tokens, streams=list(streams), runs=runs,
                      verdicts=verdicts, positions=measured)


def position_sensitivity(engine: KVEngine, docs: Sequence[dict[str, Any]], questions: Sequence[dict[str, Any]], *,
                         k: int = 3, max_new_tokens: int = 24,
                         phrasings: Literal["asked", "all"] = "asked") -> PositionSensitivity:
    """For every question (and, with `phrasings="all"`, each of its paraphrases) whose own document
    (`doc_id`) is among its top k but not alone there: text RAG with that document read at each of
    the k positions, the others in retrieval order. Questions marked `recurring` are left out."""
    if k < 2:
        raise InputError("position sensitivity needs k >= 2: one document has one position")
    by_id = {str(d["id"]): str(d["text"]) for d in docs}
    index = corpus_index(docs)
    options = GenerationOptions(max_new_tokens=max_new_tokens)
    hits: list[list[float]] = [[] for _ in range(k)]
    names: list[str] = []
    for q in questions:
        own = by_id.get(str(q.get("doc_id")))
        if own is None or q.get("recurring"):
            continue
        for phrasing in [str(q["question"]), *(map(str, q.get("paraphrases", ())) if phrasings == "all" else ())]:
            found = [d.text for d, _ in index.search(phrasing, k)]
            if own not in found or len(found) < k:
                continue
            others = [t for t in found if t != own]
            for position in range(k):
                texts = [*others[:position], own, *others[position:]]
                answer = engine.generate(phrasing, states=texts, options=options, graft=False, memo=False).text
                hits[position].append(float(contains_gold(answer, [str(a) for a in q["answers"]])))
            names.append(str(q["id"]))
    if not names:
        raise InputError("no question has its own document (doc_id) among its top k: nothing to move")
    return PositionSensitivity(k=k, questions=len(names),
                               accuracy_by_position=[bootstrap_mean(h, names) for h in hits])
