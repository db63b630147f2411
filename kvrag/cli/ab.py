"""`kvrag ab` (text RAG against KV RAG on your data) and `kvrag calibrate` (the blend gate)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional

import typer
from rich.table import Table

from kvrag.cli.common import (
    ATTN,
    DEADLINE,
    DTYPE,
    JSON,
    LAYOUT,
    MODEL,
    NAMESPACE,
    SIGNING_KEY_FILE,
    STORE,
    THREADS,
    Attn,
    Dtype,
    Layout,
    Trust,
    engine_for,
    err,
    fail,
    out,
    progress,
)
from kvrag.errors import InputError, KVRagError

if TYPE_CHECKING:
    from kvrag.apps.ab import ABSummary, LeverSweep
    from kvrag.engine.engine import KVEngine

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    app.command(epilog=AB_EXAMPLES)(ab)
    app.command(epilog="Example: kvrag calibrate --model smollm2-135m --ratio 0.15 --samples 8")(calibrate)


AB_EXAMPLES = """Examples:

  kvrag ab --docs docs.jsonl --questions questions.jsonl --k 3 --policy lazy --out ab.json --report ab-report

  kvrag ab --k 3 --stream zipf --stream-n 80 --zipf-s 1.1 --seed 0 --order canonical    (skewed traffic, bundled set)

  kvrag ab --k 3 --chapters 768    (the corpus as chapters of at most 768 tokens, each grafted whole)

  kvrag ab --k 3 --order canonical --streams 3 --stream-n 80 --positions    (the lever on 3 independent
  streams: whole-context share and accuracy against retrieval order, with 95% intervals)"""


ORDER = typer.Option("retrieval", help="retrieval; stored-first: the longest stored chain first; canonical: one "
                     "fixed order (by each document's hash) (both arms; accuracy in retrieval order is reported beside)")
STREAM = typer.Option(None, help="instead of QUESTIONS as given, draw --stream-n questions: documents uniformly or by "
                      "Zipf popularity, then a question and one of its phrasings (paraphrases)")
STREAM_N = typer.Option(80, "--stream-n", min=1, help="questions in a drawn stream")
ZIPF_S = typer.Option(1.1, "--zipf-s", min=0.0, max=10.0, help="the Zipf exponent of a zipf stream")
SEED = typer.Option(0, help="the seed of a drawn stream (the same seed, the same stream)")
ADMIT_AFTER = typer.Option(1, "--admit-after", min=1, max=1000, help="lazy: deposit a chain read as text from its "
                           "N-th reading on (1: the first)")
BLEND = typer.Option(None, "--blend", min=0.01, max=1.0, help="approximate: blend documents whose chain state is missing, "
                     "recomputing this share of their tokens (gated)")
CHAPTERS = typer.Option(None, "--chapters", min=1, help="cut the corpus into chapters of at most N tokens (by the "
                        "retriever's similarity), each deposited as a chain; a question reads the chapter holding most "
                        "of its top k, then the others as text")
STREAMS = typer.Option(None, "--streams", min=1, max=100, help="measure the lever (--order, --chapters, --corpus-chain, "
                       "--warm-chains, --blend, --admit-after) on N independent streams drawn from QUESTIONS (seeds "
                       "from --seed, skews and phrasing sets in turn), each beside retrieval order on a fresh memory "
                       "store; reports whole-context share and accuracy against retrieval order with 95% intervals")
POSITIONS = typer.Option(False, "--positions", help="with --streams: also measure text RAG accuracy with each question's "
                         "own document read at each of the k positions")
STOCK = typer.Option(None, "--stock/--no-stock", help="also run the stock completion arm: a plain completion prompt and "
                     "model.generate (default: for base models)")


def ab(
    docs: Optional[str] = typer.Option(None, help='DOCS.jsonl, lines {"id", "title", "text"} (default: the bundled sample set)'),
    questions: Optional[str] = typer.Option(None, help='QUESTIONS.jsonl, lines {"id", "question", "answers": [...]} (+ "doc_id", "recurring")'),
    model: str = MODEL,
    store: Optional[str] = STORE,
    dtype: Dtype = DTYPE,
    attn: Attn = ATTN,
    layout: Optional[Layout] = LAYOUT,
    k: int = typer.Option(1, min=1, help="documents retrieved per question"),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1, help="the most tokens an answer may have"),
    policy: Literal["lazy", "warm"] = typer.Option("lazy", help="lazy: documents deposited once, chains as questions form them; "
                                            "warm: each question's whole chain deposited right before it"),
    order: Literal["retrieval", "stored-first", "canonical"] = ORDER,
    stream: Optional[Literal["uniform", "zipf"]] = STREAM,
    stream_n: int = STREAM_N,
    zipf_s: float = ZIPF_S,
    seed: int = SEED,
    corpus_chain: bool = typer.Option(False, "--corpus-chain", help="the whole corpus as one chain, read by every question"),
    chapters: Optional[int] = CHAPTERS,
    warm_chains: bool = typer.Option(False, "--warm-chains", help="deposit co-retrieved chains after answers"),
    admit_after: int = ADMIT_AFTER,
    blend: Optional[float] = BLEND,
    out_path: Optional[str] = typer.Option(None, "--out", help="write the summary and rows to this JSON file"),
    report: Optional[str] = typer.Option(None, help="write report.md and PNG plots into this folder"),
    stock: Optional[bool] = STOCK,
    streams: Optional[int] = STREAMS,
    positions: bool = POSITIONS,
    namespace: Optional[str] = NAMESPACE,
    signing_key_file: Optional[str] = SIGNING_KEY_FILE,
    deadline: Optional[float] = DEADLINE,
    threads: Optional[int] = THREADS,
    as_json: bool = JSON,
) -> None:
    """Compare text RAG and KV RAG on the same retrieval, prompt and decoding."""
    try:
        doc_rows, question_rows = _inputs(docs, questions)
        trust = Trust(namespace, signing_key_file, deadline, threads)
        options = dict(order=order, corpus_chain=corpus_chain, chapters=chapters, warm_chains=warm_chains, blend=blend,
                       admit_after=admit_after, policy=policy)
        if streams is not None:
            result: "ABSummary | LeverSweep" = _sweep(doc_rows, question_rows, options, streams, stream, store, positions,
                                                      model, dtype, attn, layout, trust, k, max_tokens, stream_n, zipf_s,
                                                      seed, as_json)
        else:
            if positions:
                raise InputError("--positions is measured with --streams")
            if stream is not None:  # the file's questions become the population a stream draws from
                question_rows = _drawn(doc_rows, question_rows, stream, stream_n, zipf_s, seed)
            result = _compare(doc_rows, question_rows, options, engine_for(model, store, dtype, attn, layout, trust), k,
                              max_tokens, stock, report, as_json)
    except KVRagError as e:
        fail(e)
    if out_path:
        Path(out_path).write_text(result.model_dump_json(indent=2), encoding="utf-8")
    if as_json:
        print(result.model_dump_json(indent=2))
    else:
        _print_sweep(result) if streams is not None else _print_summary(result)  # type: ignore[arg-type]


def _inputs(docs: Optional[str], questions: Optional[str]) -> tuple[list[dict], list[dict]]:
    """The documents and questions files (default: the bundled sample set), read and checked."""
    from kvrag.apps.ab import load_jsonl
    from kvrag.data import sample_paths

    default_docs, default_questions = sample_paths()
    return (load_jsonl(docs or default_docs, ["id", "title", "text"]),
            load_jsonl(questions or default_questions, ["id", "question", "answers"]))


def _drawn(docs: list[dict], questions: list[dict], stream: str, n: int, s: float, seed: int) -> list[dict]:
    from kvrag.apps.ab import skewed_stream

    return skewed_stream(docs, questions, n=n, stream=stream, s=s, seed=seed)  # type: ignore[arg-type]


def _compare(docs: list[dict], questions: list[dict], options: dict, engine: "KVEngine", k: int, max_tokens: int,
             stock: Optional[bool], report: Optional[str], quiet: bool) -> "ABSummary":
    """One A/B run of both arms over `questions`, with a progress bar, and its report where asked."""
    from kvrag.apps.ab import run_ab, write_report

    with progress(quiet) as bar:
        task = bar.add_task("A/B", total=len(questions))
        summary = run_ab(engine, docs, questions, k=k, max_new_tokens=max_tokens, stock=stock,
                         progress=lambda done, _n: bar.update(task, completed=done), **options)
    if report:
        err.print(f"report: {write_report(summary, report)}")
    return summary


def _sweep(docs: list[dict], questions: list[dict], options: dict, count: int, stream: Optional[str], store: Optional[str],
           positions: bool, model: str, dtype: str, attn: str, layout: Optional[str], trust: Trust, k: int,
           max_tokens: int, stream_n: int, zipf_s: float, seed: int, quiet: bool) -> "LeverSweep":
    from kvrag.apps.ab import independent_streams, sweep_levers
    from kvrag.core.options import RAG_DEFAULTS

    # run_ab's arguments when no lever is on: the baseline every lever is measured against
    no_lever = {"order": "retrieval", "corpus_chain": False, "chapters": None, "warm_chains": False, "blend": None,
                "admit_after": RAG_DEFAULTS.admit_after, "policy": "lazy"}
    lever = {key: value for key, value in options.items() if value != no_lever[key]}
    if not lever:
        raise InputError("--streams measures a lever against retrieval order: name one (--order canonical, "
                         "--order stored-first, --chapters N, --corpus-chain, --warm-chains, --blend R, --admit-after N)")
    if stream is not None or store is not None:
        raise InputError("--streams draws its own streams (--stream-n, --zipf-s, --seed) and runs each on a fresh "
                         "memory store: leave out --stream and --store")
    name = ", ".join(f"{key.replace('_', ' ')} {value}" for key, value in lever.items())
    engine = engine_for(model, "memory://", dtype, attn, layout, trust)
    with progress(quiet) as bar:
        tasks: dict[str, int] = {}

        def report(label: str, done: int, total: int) -> None:
            task = tasks.get(label)
            if task is None:
                task = tasks[label] = bar.add_task(label, total=total)
            bar.update(task, completed=done)

        return sweep_levers(engine, docs, questions, {name: lever}, streams=independent_streams(
            count, n=stream_n, seed=seed, s=zipf_s), k=k, max_new_tokens=max_tokens, positions=positions,
            progress=report)


def _print_sweep(sweep: "LeverSweep") -> None:
    table = Table("stream", "whole context: lever / none", "accuracy: lever / retrieval order [95%]",
                  "difference [95%]", "answers changed", "holds",
                  title=f"kvrag ab: {sweep.model}, k={sweep.k}, {len(sweep.streams)} streams")
    for r in sweep.runs:
        ci = r.accuracy_retrieval_order
        table.add_row(r.stream.label, f"{r.whole_context:.2f} / {r.whole_context_baseline:.2f}",
                      f"{r.accuracy:.2f} / {ci.estimate:.2f} [{ci.low:.2f}, {ci.high:.2f}]", str(r.difference),
                      f"{r.answers_changed} of {r.n}", "yes" if r.holds else "[red]no[/]")
    out.print(table)
    for v in sweep.verdicts:
        verdict = ("[green]holds on every stream and pooled[/]" if v.holds
                   else "[red]costs accuracy (on a stream, or pooled over them)[/]")
        out.print(f"{v.lever}: whole context {v.whole_context.mean:.2f} ({v.whole_context.low:.2f}-"
                  f"{v.whole_context.high:.2f}) against {v.whole_context_baseline.mean:.2f}; accuracy difference "
                  f"{v.difference} over {v.rows} questions; {verdict}")
    if sweep.positions:
        p = sweep.positions
        out.print(f"own document read at position 1..{p.k} ({p.questions} questions): " + ", ".join(
            f"{a.estimate:.2f} [{a.low:.2f}, {a.high:.2f}]" for a in p.accuracy_by_position))


def _print_summary(summary: "ABSummary") -> None:
    from kvrag.apps.ab import summary_rows

    levers = f", {', '.join(summary.levers)}" if summary.levers else ""
    table = Table("figure", "value", title=f"kvrag ab: {summary.model}, k={summary.k}, {summary.n} questions, "
                  f"policy {summary.policy}{levers}")
    for name, value in summary_rows(summary):
        table.add_row(name, value)
    out.print(table)


def calibrate(
    model: str = MODEL,
    store: Optional[str] = STORE,
    dtype: Dtype = DTYPE,
    attn: Attn = ATTN,
    ratio: float = typer.Option(0.15, min=0.01, max=1.0, help="share of a moved document's tokens recomputed"),
    samples: int = typer.Option(8, min=1, help="two-document prompts measured"),
    docs: Optional[str] = typer.Option(None, help='DOCS.jsonl, lines {"id", "text"} (default: the bundled sample set)'),
    max_kl: float = typer.Option(0.1, help="the most mean first-token KL (nats) the gate lets through (0.1 at most)"),
    min_agreement: float = typer.Option(0.8, help="the least first-token argmax agreement the gate lets through "
                                        "(0.8 at least)"),
    namespace: Optional[str] = NAMESPACE,
    signing_key_file: Optional[str] = SIGNING_KEY_FILE,
    deadline: Optional[float] = DEADLINE,
    threads: Optional[int] = THREADS,
    as_json: bool = JSON,
) -> None:
    """Measure blending against the exact path for this model and store the gate's verdict."""
    from kvrag.apps.ab import load_jsonl

    try:
        texts = [str(d["text"]) for d in load_jsonl(docs, ["id", "text"])] if docs else None
        engine = engine_for(model, store, dtype, attn, None, Trust(namespace, signing_key_file, deadline, threads))
        with progress(as_json) as bar:
            task = bar.add_task(f"calibrating blend {ratio:.2f}", total=samples)
            result = engine.gate.calibrate(texts, ratio=ratio, samples=samples, max_mean_kl=max_kl,
                                           min_agreement=min_agreement,
                                           progress=lambda done, _n: bar.update(task, completed=done))
    except KVRagError as e:
        fail(e)
    if as_json:
        print(result.model_dump_json(indent=2))
        return
    verdict = "[green]allowed[/]" if result.passed else "[red]refused[/]"
    out.print(f"blend {result.ratio:.2f} for {result.model}: {verdict} (mean KL {result.kl_mean:.3g}, max "
              f"{result.kl_max:.3g}; argmax agreement {result.argmax_agreement:.0%} over {result.samples} prompts)")
