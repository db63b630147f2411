"""A LangChain RAG chain on kvrag, offline: smollm2-135m, the bundled documents, graft vs plain text.

    python examples/langchain_rag.py
"""

from __future__ import annotations

from langchain_core.documents import Document
from langchain_kvrag import ChatKVRAG, KVRetriever, create_kv_rag_chain

from kvrag import KVEngine, load_model
from kvrag.data import sample_docs, sample_questions


def main(store: str = "memory://", questions: int = 4, k: int = 1) -> list[dict]:
    engine = KVEngine(load_model("smollm2-135m"), store)
    documents = [Document(page_content=d.text, metadata={"title": d.title}, id=d.id) for d in sample_docs()]

    # The swap: a KVRetriever around your retriever (here kvrag's small index), and ChatKVRAG as the LLM.
    retriever = KVRetriever(engine=engine, documents=documents, k=k)
    kv_chain = create_kv_rag_chain(retriever, ChatKVRAG(engine=engine, max_tokens=32))
    text_chain = create_kv_rag_chain(retriever, ChatKVRAG(engine=engine, max_tokens=32, graft=False))

    rows = []
    for q in sample_questions()[:questions]:
        kv, text = kv_chain.invoke(q.question), text_chain.invoke(q.question)
        kv_receipt, text_receipt = kv.response_metadata["kvrag_receipt"], text.response_metadata["kvrag_receipt"]
        rows.append({"question": q.question, "answer": kv.text, "text_answer": text.text,
                     "mode": kv_receipt["mode"], "text_mode": text_receipt["mode"],
                     "ttft_ms": kv_receipt["timings"]["ttft_ms"], "text_ttft_ms": text_receipt["timings"]["ttft_ms"]})
        print(f"Q: {q.question}\nA: {kv.text}\n   {kv_receipt['mode']} {kv_receipt['timings']['ttft_ms']:.0f} ms | "
              f"plain text: {text_receipt['mode']} {text_receipt['timings']['ttft_ms']:.0f} ms, "
              f"same answer: {kv.text == text.text}\n")
    return rows


if __name__ == "__main__":
    main()
