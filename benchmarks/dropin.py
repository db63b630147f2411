"""Unchanged pipelines: LangChain's tutorial RAG chain and LlamaIndex's default query engine, with
only the model swapped for kvrag, against the same pipelines reading text.

For each bundled question (in one process, on one machine): the text pipeline (`graft=False`,
the same prompt in the same segments), the first ask through kvrag (what it grafts from earlier
questions' deposits; what it read is deposited in the background after it answers), the same ask
again at once (it waits for that deposit, then grafts), and once more after the deposit is stored.
TTFT comes from each answer's receipt; ratios are text TTFT / kvrag TTFT per question, then the
median; "total vs text" is the first ask's wall time over the text pipeline's.

    python benchmarks/dropin.py                        # Markdown table
    python benchmarks/dropin.py --k 3 --json out.json  # also the raw figures
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

from tqdm import tqdm

from kvrag import KVEngine, MemoryStore, load_model
from kvrag.data import sample_docs, sample_questions

TEMPLATE = "Answer the question based only on the following context:\n{context}\n\nQuestion: {question}\n"


def langchain_arm(engine: KVEngine, k: int, max_tokens: int):  # type: ignore[no-untyped-def]
    from langchain_community.retrievers import BM25Retriever
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.documents import Document
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_kvrag import ChatKVRAG

    retriever = BM25Retriever.from_documents([Document(page_content=d.text, id=d.id) for d in sample_docs()], k=k)

    def chain(graft: bool):  # type: ignore[no-untyped-def]
        llm = ChatKVRAG(engine=engine, max_tokens=max_tokens, graft=graft)
        context = retriever | (lambda docs: "\n\n".join(d.page_content for d in docs))
        return {"context": context, "question": RunnablePassthrough()} | ChatPromptTemplate.from_template(TEMPLATE) | llm | StrOutputParser()

    class Receipts(BaseCallbackHandler):
        def __init__(self) -> None:
            self.receipts: list[dict] = []

        def on_llm_end(self, response, **kwargs) -> None:  # type: ignore[no-untyped-def]
            self.receipts.append(response.generations[0][0].message.response_metadata["kvrag_receipt"])

    def ask(graft: bool, question: str) -> tuple[str, list[dict]]:
        seen = Receipts()
        return chain(graft).invoke(question, config={"callbacks": [seen]}), seen.receipts

    return ask


def llamaindex_arm(engine: KVEngine, k: int, max_tokens: int):  # type: ignore[no-untyped-def]
    import hashlib
    import re

    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import BaseEmbedding
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
    from llama_index.llms.kvrag import KVRagLLM

    class HashingEmbedding(BaseEmbedding):
        def _vector(self, text: str) -> list[float]:
            vector = [0.0] * 256
            for word in re.findall(r"\w+", text.lower()):
                vector[int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "big") % 256] += 1.0
            norm = sum(v * v for v in vector) ** 0.5 or 1.0
            return [v / norm for v in vector]

        def _get_text_embedding(self, text: str) -> list[float]:
            return self._vector(text)

        def _get_query_embedding(self, query: str) -> list[float]:
            return self._vector(query)

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._vector(query)

    class Receipts(BaseEventHandler):
        receipts: list = []

        def handle(self, event, **kwargs) -> None:  # type: ignore[no-untyped-def]
            if isinstance(event, LLMChatEndEvent) and event.response is not None:
                self.receipts.append(event.response.additional_kwargs.get("kvrag_receipt"))

    index = VectorStoreIndex.from_documents([Document(text=d.text, id_=d.id) for d in sample_docs()],
                                            embed_model=HashingEmbedding())
    engines = {graft: index.as_query_engine(llm=KVRagLLM(engine=engine, max_new_tokens=max_tokens, graft=graft),
                                            similarity_top_k=k) for graft in (True, False)}

    def ask(graft: bool, question: str) -> tuple[str, list[dict]]:
        handler = Receipts(receipts=[])
        get_dispatcher().add_event_handler(handler)
        try:
            return str(engines[graft].query(question)), [r for r in handler.receipts if r]
        finally:
            get_dispatcher().event_handlers.remove(handler)

    return ask


def run(name: str, ask, engine: KVEngine, questions: list[str]) -> dict:  # type: ignore[no-untyped-def]
    rows = []
    for question in tqdm(questions, desc=name, unit="question"):
        began = time.perf_counter()
        text_answer, text_receipts = ask(False, question)
        text_total_ms = (time.perf_counter() - began) * 1e3
        began = time.perf_counter()
        first_answer, first_receipts = ask(True, question)
        first_total_ms = (time.perf_counter() - began) * 1e3
        # asked again at once, the question waits for the deposit of what the first ask read
        at_once_answer, at_once_receipts = ask(True, question)
        engine.deposits.wait()
        again_answer, again_receipts = ask(True, question)
        rows.append({
            "question": question,
            "text_ttft_ms": sum(r["timings"]["ttft_ms"] for r in text_receipts),
            "first_ttft_ms": sum(r["timings"]["ttft_ms"] for r in first_receipts),
            "first_total_ms": first_total_ms,
            "text_total_ms": text_total_ms,
            "at_once_ttft_ms": sum(r["timings"]["ttft_ms"] for r in at_once_receipts),
            "at_once_modes": [r["mode"] for r in at_once_receipts],
            "again_ttft_ms": sum(r["timings"]["ttft_ms"] for r in again_receipts),
            "first_modes": [r["mode"] for r in first_receipts],
            "again_modes": [r["mode"] for r in again_receipts],
            "prompt_tokens": sum(r["tokens_reused"] + r["tokens_prefilled"] for r in again_receipts),
            "first_reused": sum(r["tokens_reused"] for r in first_receipts),
            "again_reused": sum(r["tokens_reused"] for r in again_receipts),
            "same_answers": first_answer == at_once_answer == again_answer == text_answer,
        })
    return {"pipeline": name, "rows": rows}


def summary(result: dict) -> str:
    rows = result["rows"]
    first_modes = Counter(m for r in rows for m in r["first_modes"])
    again_modes = Counter(m for r in rows for m in r["again_modes"])
    median = statistics.median
    return (
        f"| {result['pipeline']} | {len(rows)} | {median(r['prompt_tokens'] for r in rows):.0f} | "
        f"{', '.join(f'{m} {n}' for m, n in first_modes.most_common())} | "
        f"{median(r['text_ttft_ms'] / r['first_ttft_ms'] for r in rows):.2f}x | "
        f"{median(r['first_total_ms'] / r['text_total_ms'] for r in rows):.2f}x | "
        f"{median(r['text_ttft_ms'] / r['at_once_ttft_ms'] for r in rows):.2f}x | "
        f"{', '.join(f'{m} {n}' for m, n in again_modes.most_common())} | "
        f"{median(r['text_ttft_ms'] / r['again_ttft_ms'] for r in rows):.1f}x | "
        f"{sum(r['same_answers'] for r in rows)}/{len(rows)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--k", type=int, default=2, help="documents retrieved per question")
    parser.add_argument("--questions", type=int, default=18)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    model = load_model(args.model)
    questions = [q.question for q in sample_questions()[: args.questions]]
    results = [
        run(name, arm(engine, args.k, args.max_tokens), engine, questions)
        for name, arm in (("LangChain RAG chain (BM25)", langchain_arm), ("LlamaIndex as_query_engine", llamaindex_arm))
        for engine in [KVEngine(model, MemoryStore())]
    ]
    print(f"{args.model}, k={args.k}, memory store, {args.max_tokens} answer tokens at most\n")
    print("| pipeline | questions | prompt tokens (median) | first ask: modes | first ask: TTFT ratio | "
          "first ask: total vs text | asked again at once: TTFT ratio | asked again: modes | asked again: TTFT ratio | "
          "same answer as text |")
    print("|---|---:|---:|---|---:|---:|---:|---|---:|---:|")
    for result in results:
        print(summary(result))
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "k": args.k, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
