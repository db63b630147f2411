"""`kvrag ab`: text RAG and KV RAG side by side on your own documents and questions.

Both arms use the same retrieval (kvrag's lexical index, top k), the same prompt layout and greedy
decoding. The text arm re-reads the retrieved documents as text, in the same token ids and
segments the KV arm grafts, so the two must agree exactly; a third, conventional arm tokenizes the
whole prompt string at once and prefills it in one pass, as plain text RAG does, and is reported
beside them (its bytes differ slightly). A KV answer that contains a gold answer is verified by
that check and memoized; a later `recurring` variant of the question must then be a memo hit.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Callable, Sequence

from pydantic import BaseModel

from kvrag.continuation import Continuation
from kvrag.engine import Generation, KVEngine
from kvrag.errors import InputError
from kvrag.index import IndexedDoc, LexicalIndex
from kvrag.memo import Provenance

__all__ = ["ABRow", "ABSummary", "load_jsonl", "run_ab", "write_report"]


class ABRow(BaseModel):
    id: str
    question: str
    answers: list[str]
    recurring: bool
    doc_ids: list[str]
    prompt_tokens: int
    text_answer: str
    kv_answer: str
    monolithic_answer: str
    text_hit: bool
    kv_hit: bool
    text_mode: str
    kv_mode: str
    ttft_text_ms: float
    ttft_kv_ms: float
    prefill_tokens_text: int
    prefill_tokens_kv: int
    decode_tokens_text: int
    decode_tokens_kv: int
    logits_sha256_text: str
    logits_sha256_kv: str
    memoized: bool


class ABSummary(BaseModel):
    model: str
    store: str
    k: int
    n: int
    accuracy_text: float
    accuracy_kv: float
    answer_agreement: float
    logits_byte_exact_rate: float
    answer_agreement_monolithic: float
    ttft_text_ms_median: float
    ttft_kv_ms_median: float
    ttft_ratio_median: float
    prefill_tokens_text: int
    prefill_tokens_kv: int
    decode_tokens_text: int
    decode_tokens_kv: int
    memo_hits: int
    recurring: int
    exact_rows: int
    rows: list[ABRow]


def load_jsonl(path: str | Path, required: Sequence[str]) -> list[dict[str, Any]]:
    """Read a JSONL file whose lines are objects with the `required` fields; a bad line is an InputError."""
    rows = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise InputError(f"cannot read {path}: {e}") from e
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise InputError(f"{path}:{number} is not JSON: {e}") from e
        missing = [f for f in required if not isinstance(row, dict) or f not in row]
        if missing:
            raise InputError(f"{path}:{number} lacks {', '.join(missing)}")
        rows.append(row)
    if not rows:
        raise InputError(f"{path} has no lines")
    return rows


def _hit(answer: str, golds: Sequence[str]) -> bool:
    return any(g.casefold() in answer.casefold() for g in golds)


def _monolithic(engine: KVEngine, texts: list[str], question: str, max_new_tokens: int) -> Generation:
    """The conventional arm: the whole prompt string tokenized at once, prefilled in one pass."""
    segments = engine.plan(texts)
    ids = [i for s in segments for i in s.ids] + engine.planner.question(question, segments)
    tokenizer = engine.model.tokenizer
    ids = tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"]
    return engine.run(Continuation([], ids, max_new_tokens, graft=False)).result()


def run_ab(
    engine: KVEngine,
    docs: Sequence[dict[str, Any]],
    questions: Sequence[dict[str, Any]],
    *,
    k: int = 1,
    max_new_tokens: int = 32,
    progress: Callable[[int, int], None] | None = None,
) -> ABSummary:
    index = LexicalIndex([IndexedDoc(str(d["text"]), {"id": str(d["id"])}) for d in docs])
    rows: list[ABRow] = []
    for number, q in enumerate(questions, 1):
        question, golds = str(q["question"]), [str(a) for a in q["answers"]]
        found = index.search(question, k)
        texts = [d.text for d, _ in found]
        engine.deposit_chain(texts)  # once per document set; the KV arm's states
        text: Generation = engine.generate(question, states=texts, max_new_tokens=max_new_tokens, graft=False, memo=False)
        kv: Generation = engine.generate(question, states=texts, max_new_tokens=max_new_tokens)
        mono = _monolithic(engine, texts, question, max_new_tokens).text
        memoized = False
        if kv.receipt.mode != "memo" and _hit(kv.text, golds):
            engine.memo.memoize(question, kv, states=texts,
                                provenance=Provenance(kind="gold", by=f"kvrag ab: answer contains a gold answer of {q['id']}"))
            memoized = True
        rows.append(ABRow(
            id=str(q["id"]), question=question, answers=golds, recurring=bool(q.get("recurring")),
            doc_ids=[d.metadata["id"] for d, _ in found],
            prompt_tokens=text.receipt.tokens_prefilled,
            text_answer=text.text, kv_answer=kv.text, monolithic_answer=mono,
            text_hit=_hit(text.text, golds), kv_hit=_hit(kv.text, golds),
            text_mode=text.receipt.mode, kv_mode=kv.receipt.mode,
            ttft_text_ms=text.receipt.timings.ttft_ms, ttft_kv_ms=kv.receipt.timings.ttft_ms,
            prefill_tokens_text=text.receipt.tokens_prefilled, prefill_tokens_kv=kv.receipt.tokens_prefilled,
            decode_tokens_text=text.receipt.decode_tokens, decode_tokens_kv=kv.receipt.decode_tokens,
            logits_sha256_text=text.receipt.first_token_logits_sha256, logits_sha256_kv=kv.receipt.first_token_logits_sha256,
            memoized=memoized,
        ))
        if progress:
            progress(number, len(questions))
    exact = [r for r in rows if r.kv_mode != "memo"]
    n = len(rows)
    ratio = [r.ttft_text_ms / r.ttft_kv_ms for r in rows]
    return ABSummary(
        model=engine.model.name, store=engine.store.url, k=k, n=n,
        accuracy_text=sum(r.text_hit for r in rows) / n,
        accuracy_kv=sum(r.kv_hit for r in rows) / n,
        answer_agreement=sum(r.text_answer == r.kv_answer for r in exact) / max(len(exact), 1),
        logits_byte_exact_rate=sum(r.logits_sha256_text == r.logits_sha256_kv for r in exact) / max(len(exact), 1),
        answer_agreement_monolithic=sum(r.monolithic_answer == r.kv_answer for r in exact) / max(len(exact), 1),
        ttft_text_ms_median=statistics.median(r.ttft_text_ms for r in rows),
        ttft_kv_ms_median=statistics.median(r.ttft_kv_ms for r in rows),
        ttft_ratio_median=statistics.median(ratio),
        prefill_tokens_text=sum(r.prefill_tokens_text for r in rows),
        prefill_tokens_kv=sum(r.prefill_tokens_kv for r in rows),
        decode_tokens_text=sum(r.decode_tokens_text for r in rows),
        decode_tokens_kv=sum(r.decode_tokens_kv for r in rows),
        memo_hits=sum(r.kv_mode == "memo" for r in rows),
        recurring=sum(r.recurring for r in rows),
        exact_rows=len(exact),
        rows=rows,
    )


def write_report(summary: ABSummary, folder: str | Path) -> Path:
    """`report.md` with three PNG plots beside it: TTFT by prompt length, prefill tokens, agreement."""
    try:
        import matplotlib
    except ImportError as e:
        raise InputError("the A/B report's plots need matplotlib: pip install 'kvrag[report]'") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = summary.rows

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, attr, marker in (("text RAG (re-read)", "ttft_text_ms", "o"), ("KV RAG (graft / memo)", "ttft_kv_ms", "s")):
        ax.scatter([r.prompt_tokens for r in rows], [getattr(r, attr) for r in rows], label=label, marker=marker)
    ax.set_xlabel("prompt tokens (documents + question)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_yscale("log")
    ax.set_title(f"Time to first token, {summary.model}, k={summary.k}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "ttft_by_length.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.2))
    positions = range(len(rows))
    ax.bar([p - 0.2 for p in positions], [r.prefill_tokens_text for r in rows], width=0.4, label="text RAG")
    ax.bar([p + 0.2 for p in positions], [r.prefill_tokens_kv for r in rows], width=0.4, label="KV RAG")
    ax.set_xticks(list(positions), [r.id for r in rows], rotation=60, fontsize=7)
    ax.set_ylabel("tokens prefilled")
    ax.set_title(f"Prefill tokens: {summary.prefill_tokens_text:,} (text) vs {summary.prefill_tokens_kv:,} (KV)")
    ax.set_ylim(0, max([r.prefill_tokens_text for r in rows] + [1]) * 1.2)
    ax.legend(loc="upper center", ncols=2)
    fig.tight_layout()
    fig.savefig(folder / "prefill_tokens.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = ["accuracy\ntext", "accuracy\nKV", "answer\nagreement", "logits\nbyte-exact", "agreement vs\nmonolithic"]
    values = [summary.accuracy_text, summary.accuracy_kv, summary.answer_agreement, summary.logits_byte_exact_rate,
              summary.answer_agreement_monolithic]
    bars = ax.bar(labels, values, color=["#7a9cc6", "#7a9cc6", "#5aa469", "#5aa469", "#d4a373"])
    ax.bar_label(bars, [f"{v:.2f}" for v in values])
    ax.set_ylim(0, 1.1)
    ax.set_title("Agreement (exact rows) and accuracy (all rows)")
    fig.tight_layout()
    fig.savefig(folder / "agreement.png", dpi=120)
    plt.close(fig)

    s = summary
    lines = [
        f"# kvrag A/B: {s.model}, k={s.k}, store `{s.store}`",
        "",
        "| figure | value |", "|---|---:|",
        f"| questions | {s.n} ({s.recurring} recurring) |",
        f"| accuracy, text RAG / KV RAG | {s.accuracy_text:.2f} / {s.accuracy_kv:.2f} |",
        f"| answer agreement (exact rows) | {s.answer_agreement:.2f} |",
        f"| first-token logits byte-exact (exact rows) | {s.logits_byte_exact_rate:.2f} |",
        f"| answer agreement with one monolithic pass | {s.answer_agreement_monolithic:.2f} |",
        f"| median TTFT, text / KV | {s.ttft_text_ms_median:.0f} ms / {s.ttft_kv_ms_median:.0f} ms |",
        f"| median TTFT ratio | {s.ttft_ratio_median:.1f}x |",
        f"| prefill tokens, text / KV | {s.prefill_tokens_text:,} / {s.prefill_tokens_kv:,} |",
        f"| decode tokens, text / KV | {s.decode_tokens_text:,} / {s.decode_tokens_kv:,} |",
        f"| memo hits | {s.memo_hits} |",
        "",
        "![TTFT by prompt length](ttft_by_length.png)", "",
        "![Prefill tokens](prefill_tokens.png)", "",
        "![Agreement](agreement.png)", "",
        "| id | question | KV answer | modes (text / KV) | TTFT text / KV | hit text / KV |",
        "|---|---|---|---|---:|---|",
    ]
    for r in rows:
        answer = r.kv_answer.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.id} | {r.question} | {answer} | {r.text_mode} / {r.kv_mode} | "
                     f"{r.ttft_text_ms:.0f} / {r.ttft_kv_ms:.0f} ms | {r.text_hit} / {r.kv_hit} |")
    path = folder / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
