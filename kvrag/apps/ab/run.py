"""`kvrag ab`: text RAG and KV RAG side by side on your own documents and questions.

Both arms use the same retrieval (kvrag's lexical index, top k), the same prompt layout and greedy
decoding. The text arm re-reads the retrieved documents as text, in the same token ids and
segments the KV arm grafts, so the two must agree exactly; a third, conventional arm is what a
user's own pipeline runs: the whole prompt string tokenized at once and a stock greedy
`model.generate`. Its answers and first-token logits are reported beside them: with sdpa or eager
its bytes differ slightly, with the invariant kernel (`attn="invariant"`) they are equal. For a base
model (the completion layout) a fourth, `stock` arm is what a user of that model writes without
kvrag: the documents and `Question: ... / Answer:` as one plain completion prompt
(`STOCK_COMPLETION`), `tokenizer(prompt)` with its default special tokens, and a stock greedy
`model.generate`; its accuracy is printed beside both arms'. A KV answer that contains a gold answer is verified by
that check and memoized; a later `recurring` variant of the question must then be a memo hit.

The deposit policy says what was stored before each question, because that is what decides the
KV arm's speed:

    lazy   (default) each document deposited once, up front (its cost reported); chains form only
           as questions arrive (`deposit_missing`), as in an application
    warm   each question's whole retrieved chain deposited right before its KV arm: the speed a
           user gets only when every chain is already stored

The exact levers of `kvrag.reuse.levers` and `kvrag.reuse.chapters` are opt-in (`order="stored-first"`, `corpus_chain`, `chapters`,
`warm_chains`), and so is the approximate blend (`blend`, see `kvrag.reuse.blend`, gated by
`kvrag.reuse.gate`), whose rows are labelled `approximate-graft` and measured against the text arm. Where a lever changed the prompt (the order), the text arm reads the same prompt
and the row also says whether the answer differs from text RAG in retrieval order.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter, OrderedDict
from typing import Any, Callable, Sequence

import torch

from kvrag.apps.ab.results import ABRow, ABSummary, Order, Policy, contains_gold
from kvrag.core.decoding import Generation, cut_at_stops
from kvrag.core.options import RAG_DEFAULTS, GenerationOptions
from kvrag.core.runner import logits_sha256
from kvrag.engine.engine import KVEngine
from kvrag.errors import InputError, KVRagError, VerificationError
from kvrag.reuse.chapters import Chapters
from kvrag.reuse.gate import kl_divergence
from kvrag.reuse.levers import ChainWarmer, CorpusChain, reorder
from kvrag.reuse.lexical import IndexedDoc, LexicalIndex
from kvrag.reuse.memo import Provenance
from kvrag.stores import UNTRUSTED_PARSE_ERRORS

__all__ = ["run_ab", "corpus_index", "STOCK_COMPLETION"]

#: the stock arm's prompt: the documents, then the question and the answer cue, as plain text
STOCK_COMPLETION = "{documents}\n\nQuestion: {question}\nAnswer:"

#: the conventional arm's results by (model, prompt ids, tokens): a stock computation of the same
#: ids answers the same, so a prompt that recurs (in a stream, or in another configuration) runs once
_MONOLITHIC: OrderedDict[tuple[str, tuple[int, ...], int], tuple[str, str]] = OrderedDict()
_MONOLITHIC_KEPT = 4096


def _monolithic(engine: KVEngine, texts: list[str], question: str, max_new_tokens: int) -> tuple[str, str]:
    """The conventional arm, as a user's own pipeline runs it: the whole prompt string tokenized at
    once and answered by a stock greedy `model.generate`. Returns (answer, first-token logits SHA-256)."""
    segments = engine.plan(texts)
    ids = [i for s in segments for i in s.ids] + engine.planner.question(question, segments)
    tokenizer = engine.model.tokenizer
    ids = tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"]
    key = (engine.model.fingerprint.digest, tuple(ids), max_new_tokens)
    if key not in _MONOLITHIC:
        _MONOLITHIC[key] = _generate(engine, ids, max_new_tokens)
        while len(_MONOLITHIC) > _MONOLITHIC_KEPT:
            _MONOLITHIC.popitem(last=False)
    return _MONOLITHIC[key]


def _generate(engine: KVEngine, ids: list[int], max_new_tokens: int) -> tuple[str, str]:
    tokenizer = engine.model.tokenizer
    stop = sorted(engine.layout.stop_ids)
    unwritable = list(range(len(tokenizer), engine.model.vocabulary))  # ids kvrag never picks either
    with engine.model.turns.turn(), torch.inference_mode():  # the model's turn, as every forward over it
        out = engine.model.hf_model.generate(
            torch.tensor([ids], device=engine.model.device), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=stop or None, pad_token_id=stop[0] if stop else None, suppress_tokens=unwritable or None,
            output_logits=True, return_dict_in_generate=True)
    answer = [t for t in out.sequences[0, len(ids):].tolist() if t not in engine.layout.stop_ids]
    text, _ = cut_at_stops(tokenizer.decode(answer, skip_special_tokens=True), engine.layout.answer_stops)  # as kvrag's ends
    return text.strip(), logits_sha256(out.logits[0][0])


def _stock_completion(engine: KVEngine, texts: list[str], question: str, max_new_tokens: int) -> str:
    """The stock arm: a plain completion prompt as a user of a base model writes it, read by stock
    transformers calls only (its own tokenization, special tokens included, and `model.generate`)."""
    tokenizer = engine.model.tokenizer
    prompt = STOCK_COMPLETION.format(documents="\n\n".join(t.strip() for t in texts), question=question.strip())
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(engine.model.device)
    eos = tokenizer.eos_token_id
    with engine.model.turns.turn(), torch.inference_mode():
        out = engine.model.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                             do_sample=False, pad_token_id=eos)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def corpus_index(docs: Sequence[dict[str, Any]]) -> LexicalIndex:
    """The A/B's retriever over `docs`: kvrag's lexical index, each document tagged with its id."""
    return LexicalIndex([IndexedDoc(str(d["text"]), {"id": str(d["id"])}) for d in docs])


def run_ab(
    engine: KVEngine,
    docs: Sequence[dict[str, Any]],
    questions: Sequence[dict[str, Any]],
    *,
    k: int = 1,
    max_new_tokens: int = 32,
    policy: Policy = "lazy",
    order: Order = "retrieval",
    corpus_chain: bool = False,
    chapters: int | None = None,
    warm_chains: bool = False,
    blend: float | None = None,
    stock: bool | None = None,
    admit_after: int = RAG_DEFAULTS.admit_after,
    progress: Callable[[int, int], None] | None = None,
) -> ABSummary:
    """Both arms for every question (see the module docstring for `policy` and the levers), and the
    stock completion arm when `stock` (default: for a model laid out as `completion`).

    With `blend` (a recompute ratio), the KV arm blends documents whose chain state is missing
    (approximate, labelled), after calibrating the model's blend gate on `docs` if it never was;
    a refused gate leaves the KV arm exact."""
    if policy not in ("lazy", "warm") or order not in ("retrieval", "stored-first", "canonical"):
        raise InputError("policy is lazy or warm; order is retrieval, stored-first or canonical")
    index = corpus_index(docs)
    stored_before = _stored(engine)
    began = time.perf_counter()
    texts = [str(d["text"]) for d in docs]
    corpus: CorpusChain | Chapters | None = CorpusChain(engine, texts) if corpus_chain else None
    if chapters is not None:
        corpus = Chapters(engine, texts, max_tokens=chapters, similarity=index.similarity)
    if policy == "lazy" and corpus is None:
        for d in docs:
            engine.ensure(str(d["text"]))
    upfront_ms = (time.perf_counter() - began) * 1e3 if policy == "lazy" or corpus is not None else 0.0
    warmer = ChainWarmer(engine) if warm_chains else None
    gate = None
    if blend is not None:
        gate = engine.gate.result(blend) or engine.gate.calibrate([str(d["text"]) for d in docs], ratio=blend)
    rows: list[ABRow] = []
    stock = engine.layout.kind == "completion" if stock is None else stock
    for number, q in enumerate(questions, 1):
        rows.append(_row(engine, index, q, k, policy, order, corpus, warmer, blend, stock,
                         GenerationOptions(max_new_tokens=max_new_tokens, admit_after=admit_after)))
        if progress:
            progress(number, len(questions))
    levers = [name for name, on in ((order, order != "retrieval"), ("corpus-chain", corpus_chain),
                                    (f"chapters of {chapters} tokens", chapters is not None),
                                    ("warm-chains", warmer is not None), (f"blend {blend}", blend is not None)) if on]
    summary = _summary(engine, k, rows, policy, levers, upfront_ms, warmer.deposited_chains if warmer else 0)
    approximate = [r for r in rows if r.kv_mode == "approximate-graft"]
    return summary.model_copy(update={
        "bytes_stored": sum(size for key, size in _stored(engine).items() if key not in stored_before),
        "blend_ratio": blend, "blend_gate": gate.model_dump() if gate else None, "approximate_rows": len(approximate),
        "kl_mean_approximate": statistics.fmean(r.kl_vs_text or 0.0 for r in approximate) if approximate else 0.0,
        "argmax_agreement_approximate": statistics.fmean(bool(r.first_token_agrees) for r in approximate)
        if approximate else 1.0,
    })


def _row(engine: KVEngine, index: LexicalIndex, q: dict[str, Any], k: int, policy: Policy, order: Order,
         corpus: CorpusChain | Chapters | None, warmer: ChainWarmer | None, blend: float | None, stock: bool,
         options: GenerationOptions) -> ABRow:
    question, golds = str(q["question"]), [str(a) for a in q["answers"]]
    found = index.search(question, k)
    plain = [d.text for d, _ in found]  # what text RAG reads: the top k, in retrieval order
    retrieved = corpus.route(plain) if isinstance(corpus, Chapters) else corpus.texts if corpus is not None else plain
    texts = [str(t) for t in reorder(engine, retrieved, order)]  # both arms read this order
    t = time.perf_counter()
    if policy == "warm":
        engine.deposit_chain(texts)  # the KV arm's whole chain, stored right before it
    deposit_before_ms = (time.perf_counter() - t) * 1e3 if policy == "warm" else 0.0
    max_new_tokens = options.max_new_tokens
    text = engine.generate(question, states=texts, options=options, graft=False, memo=False)
    in_order = text if texts == plain else engine.generate(question, states=plain, options=options, graft=False, memo=False)
    t = time.perf_counter()
    kv = engine.generate(question, states=texts, options=options, deposit_missing=policy == "lazy", blend=blend or False)
    deposit_after_ms = max((time.perf_counter() - t) * 1e3 - kv.receipt.timings.total_ms, 0.0)
    if warmer is not None:
        warmer.observe(retrieved)
        warmer.drain()  # after the answer, before the next question: off the answer's critical path
    mono, mono_sha = _monolithic(engine, texts, question, max_new_tokens)
    stock_answer = _stock_completion(engine, retrieved, question, max_new_tokens) if stock else None
    changed = texts != retrieved
    return ABRow(
        id=str(q["id"]), question=question, answers=golds, recurring=bool(q.get("recurring")),
        doc_ids=[d.metadata["id"] for d, _ in found],
        prompt_tokens=text.receipt.tokens_prefilled,
        text_answer=text.text, kv_answer=kv.text, monolithic_answer=mono,
        stock_answer=stock_answer, stock_hit=None if stock_answer is None else contains_gold(stock_answer, golds),
        logits_sha256_monolithic=mono_sha, memoized=_memoize(engine, q, kv, texts, golds),
        text_hit=contains_gold(text.text, golds), kv_hit=contains_gold(kv.text, golds), text_retrieval_order_hit=contains_gold(in_order.text, golds),
        text_retrieval_order_answer=in_order.text,
        deposit_after_ms=deposit_after_ms, deposit_before_ms=deposit_before_ms,
        order_changed=changed, answer_changed_by_order=changed and in_order.text != text.text,
        **_receipt_figures(text, kv),
    )


def _memoize(engine: KVEngine, q: dict[str, Any], kv: Generation, texts: list[str], golds: list[str]) -> bool:
    """Memoize a KV answer that contains a gold answer (an approximate answer never is)."""
    if kv.receipt.mode == "memo" or not kv.receipt.exact or not contains_gold(kv.text, golds):
        return False
    try:
        engine.memo.memoize(str(q["question"]), kv, states=texts,
                            provenance=Provenance(kind="gold", by=f"kvrag ab: answer contains a gold answer of {q['id']}"))
        return True
    except VerificationError:  # the memo state did not reproduce the answer: nothing stored, row stands
        return False


def _receipt_figures(text: Generation, kv: Generation) -> dict[str, Any]:
    """The row's figures that the two arms' receipts and first-token logits give."""
    measured = kv.receipt.mode != "memo"  # a memo answer has no first-token logits of the question
    return dict(
        text_mode=text.receipt.mode, kv_mode=kv.receipt.mode,
        ttft_text_ms=text.receipt.timings.ttft_ms, ttft_kv_ms=kv.receipt.timings.ttft_ms,
        per_token_text_ms=text.receipt.timings.per_token_ms, per_token_kv_ms=kv.receipt.timings.per_token_ms,
        total_text_ms=text.receipt.timings.total_ms, total_kv_ms=kv.receipt.timings.total_ms,
        prefill_tokens_text=text.receipt.tokens_prefilled, prefill_tokens_kv=kv.receipt.tokens_prefilled,
        decode_tokens_text=text.receipt.decode_tokens, decode_tokens_kv=kv.receipt.decode_tokens,
        logits_sha256_text=text.receipt.first_token_logits_sha256, logits_sha256_kv=kv.receipt.first_token_logits_sha256,
        tokens_reused_kv=kv.receipt.tokens_reused,
        kl_vs_text=kl_divergence(text.first_token_logits, kv.first_token_logits) if measured else None,
        first_token_agrees=bool(text.first_token_logits.argmax() == kv.first_token_logits.argmax()) if measured else None,
        answer_changed_by_blend=kv.receipt.mode == "approximate-graft" and kv.text != text.text,
    )


def _stored(engine: KVEngine) -> dict[tuple[str, str], int]:
    """(tier, key) -> stored bytes (manifest and payload) of every state in the engine's store; a
    state that cannot be read is left out (stored bytes are a figure here, never a reason to stop)."""
    sizes = {}
    for tier in engine.store.tiers:
        for key in tier.keys():
            try:
                manifest = tier.read_manifest(key) or b""
            except KVRagError:  # a planted non-file under a state's name, say
                continue
            try:
                sizes[(tier.url, key)] = len(manifest) + int(json.loads(manifest).get("payload_bytes", 0))
            except UNTRUSTED_PARSE_ERRORS:
                sizes[(tier.url, key)] = len(manifest)  # an encrypted or damaged manifest: its own bytes only
    return sizes


def _median_of_decoded(per_token_ms: Sequence[float]) -> float:
    """The median time per decoded token over the answers that decoded after their first token (0: none)."""
    decoded = [t for t in per_token_ms if t > 0]
    return statistics.median(decoded) if decoded else 0.0


def _percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _summary(engine: KVEngine, k: int, rows: list[ABRow], policy: Policy, levers: list[str], upfront_ms: float,
             warm_chains: int) -> ABSummary:
    exact = [r for r in rows if r.kv_mode != "memo"]
    n = len(rows)
    ratio = [r.ttft_text_ms / r.ttft_kv_ms for r in rows]
    modes = Counter(r.kv_mode for r in rows)
    reused, prefilled = sum(r.tokens_reused_kv for r in rows), sum(r.prefill_tokens_kv for r in rows)
    return ABSummary(
        model=engine.model.name, store=engine.store.url, k=k, n=n,
        accuracy_text=sum(r.text_hit for r in rows) / n,
        accuracy_text_retrieval_order=sum(r.text_retrieval_order_hit for r in rows) / n,
        accuracy_kv=sum(r.kv_hit for r in rows) / n,
        accuracy_stock=sum(bool(r.stock_hit) for r in rows) / n if any(r.stock_hit is not None for r in rows) else None,
        answer_agreement=sum(r.text_answer == r.kv_answer for r in exact) / max(len(exact), 1),
        logits_byte_exact_rate=sum(r.logits_sha256_text == r.logits_sha256_kv for r in exact) / max(len(exact), 1),
        answer_agreement_monolithic=sum(r.monolithic_answer == r.kv_answer for r in exact) / max(len(exact), 1),
        monolithic_byte_exact_rate=sum(r.logits_sha256_monolithic == r.logits_sha256_kv for r in exact) / max(len(exact), 1),
        ttft_text_ms_median=statistics.median(r.ttft_text_ms for r in rows),
        ttft_kv_ms_median=statistics.median(r.ttft_kv_ms for r in rows),
        ttft_ratio_median=statistics.median(ratio),
        ttft_text_ms_p90=_percentile([r.ttft_text_ms for r in rows], 0.9),
        ttft_kv_ms_p90=_percentile([r.ttft_kv_ms for r in rows], 0.9),
        ttft_ratio_p90=_percentile(ratio, 0.9),
        ttft_ratio_sum=sum(r.ttft_text_ms for r in rows) / sum(r.ttft_kv_ms for r in rows),
        per_token_text_ms_median=_median_of_decoded([r.per_token_text_ms for r in rows]),
        per_token_kv_ms_median=_median_of_decoded([r.per_token_kv_ms for r in rows]),
        total_text_ms_median=statistics.median(r.total_text_ms for r in rows),
        total_kv_ms_median=statistics.median(r.total_kv_ms for r in rows),
        prefill_tokens_text=sum(r.prefill_tokens_text for r in rows),
        prefill_tokens_kv=prefilled,
        decode_tokens_text=sum(r.decode_tokens_text for r in rows),
        decode_tokens_kv=sum(r.decode_tokens_kv for r in rows),
        memo_hits=modes["memo"],
        recurring=sum(r.recurring for r in rows),
        exact_rows=len(exact),
        policy=policy,
        levers=levers,
        mode_mix=dict(modes.most_common()),
        ttft_ratio_by_mode={m: statistics.median(r.ttft_text_ms / r.ttft_kv_ms for r in rows if r.kv_mode == m)
                            for m in modes},
        tokens_reused_kv=reused,
        full_hit_rate=(modes["exact-graft"] + modes["memo"]) / n,
        token_reuse_rate=reused / max(reused + prefilled, 1),
        upfront_deposit_ms=upfront_ms,
        deposit_after_ms=sum(r.deposit_after_ms for r in rows),
        deposit_before_ms=sum(r.deposit_before_ms for r in rows),
        warm_chains=warm_chains,
        rows=rows,
    )
