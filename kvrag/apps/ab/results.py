"""The A/B harness's results: one row per question, the summary, and the JSONL input reader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Sequence

from pydantic import BaseModel

from kvrag.core.options import Order
from kvrag.errors import InputError

__all__ = ["ABRow", "ABSummary", "Policy", "Order", "load_jsonl", "contains_gold"]

Policy = Literal["lazy", "warm"]


def contains_gold(answer: str, golds: Sequence[str]) -> bool:
    """Whether `answer` holds one of the gold answers, case-folded: how every arm is scored."""
    return any(g.casefold() in answer.casefold() for g in golds)


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
    #: the stock completion arm's answer (base models; None: not run), and whether it holds a gold answer
    stock_answer: str | None = None
    stock_hit: bool | None = None
    text_hit: bool
    kv_hit: bool
    #: whether text RAG over the top k in retrieval order (the prompt no lever touched) holds a gold answer
    text_retrieval_order_hit: bool
    #: that answer itself (the text arm's, when no lever changed the prompt)
    text_retrieval_order_answer: str = ""
    text_mode: str
    kv_mode: str
    ttft_text_ms: float
    ttft_kv_ms: float
    #: each arm's time per decoded token after the first, and its answer's time end to end
    per_token_text_ms: float = 0.0
    per_token_kv_ms: float = 0.0
    total_text_ms: float = 0.0
    total_kv_ms: float = 0.0
    prefill_tokens_text: int
    prefill_tokens_kv: int
    decode_tokens_text: int
    decode_tokens_kv: int
    logits_sha256_text: str
    logits_sha256_kv: str
    logits_sha256_monolithic: str = ""  # the conventional arm's (stock `model.generate`) first token
    memoized: bool
    tokens_reused_kv: int = 0
    deposit_after_ms: float = 0.0  # the KV arm's deposit after answering (not in its TTFT)
    deposit_before_ms: float = 0.0  # policy warm: the chain deposited right before the KV arm
    order_changed: bool = False  # a lever reordered the retrieved documents (both arms read that order)
    answer_changed_by_order: bool = False  # ...and text RAG in retrieval order answers differently
    #: first-token KL(text arm || KV arm), measured (zero unless the KV arm blended); None: not
    #: measured, a memo answer has no first-token logits of the question to compare
    kl_vs_text: float | None = None
    first_token_agrees: bool | None = None  # measured as kl_vs_text is
    answer_changed_by_blend: bool = False  # the KV arm blended and answers differently from the text arm


class ABSummary(BaseModel):
    model: str
    store: str
    k: int
    n: int
    accuracy_text: float
    accuracy_kv: float
    #: text RAG over the top k in retrieval order; equals accuracy_text when no lever changed the prompt
    accuracy_text_retrieval_order: float
    #: the stock completion arm's accuracy (a base model's plain prompt and `model.generate`); None: not run
    accuracy_stock: float | None = None
    answer_agreement: float
    logits_byte_exact_rate: float
    answer_agreement_monolithic: float
    monolithic_byte_exact_rate: float = 0.0  # exact KV rows whose first-token logits equal the stock pass's
    ttft_text_ms_median: float
    ttft_kv_ms_median: float
    ttft_ratio_median: float
    ttft_text_ms_p90: float = 0.0
    ttft_kv_ms_p90: float = 0.0
    ttft_ratio_p90: float = 0.0  # the 90th percentile of the rows' text/KV TTFT ratios
    ttft_ratio_sum: float = 0.0  # summed text TTFTs over summed KV TTFTs (what the median hides)
    #: medians over the rows that decoded more than one token (per token) and over every row (total)
    per_token_text_ms_median: float = 0.0
    per_token_kv_ms_median: float = 0.0
    total_text_ms_median: float = 0.0
    total_kv_ms_median: float = 0.0
    prefill_tokens_text: int
    prefill_tokens_kv: int
    decode_tokens_text: int
    decode_tokens_kv: int
    memo_hits: int
    recurring: int
    exact_rows: int
    policy: Policy = "warm"
    levers: list[str] = []
    mode_mix: dict[str, int] = {}
    ttft_ratio_by_mode: dict[str, float] = {}
    tokens_reused_kv: int = 0
    full_hit_rate: float = 0.0  # rows whose whole context was grafted (exact-graft or memo)
    token_reuse_rate: float = 0.0  # KV arm tokens reused / (reused + prefilled)
    upfront_deposit_ms: float = 0.0
    deposit_after_ms: float = 0.0
    deposit_before_ms: float = 0.0
    warm_chains: int = 0
    bytes_stored: int = 0  # manifests and payloads of the states this run added, over every tier
    blend_ratio: float | None = None
    blend_gate: dict[str, Any] | None = None  # the gate's verdict for this model and ratio
    approximate_rows: int = 0
    kl_mean_approximate: float = 0.0  # over approximate rows, against the exact text arm
    argmax_agreement_approximate: float = 1.0
    rows: list[ABRow]


def load_jsonl(path: str | Path, required: Sequence[str]) -> list[dict[str, Any]]:
    """Read a JSONL file whose lines are objects with the `required` fields; a bad line is an InputError."""
    rows = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it first") from e
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
