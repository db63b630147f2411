"""A LlamaIndex query engine on kvrag, offline: smollm2-135m, the bundled documents, graft vs plain text.

    python examples/llamaindex_rag.py
"""

from __future__ import annotations

from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import TextNode
from llama_index.llms.kvrag import KVRagLLM, KVSynthesizer
from llama_index.retrievers.kvrag import KVRetriever

from kvrag import KVEngine, load_model
from kvrag.data import sample_docs, sample_questions


def main(store: str = "memory://", questions: int = 4) -> list[dict]:
    engine = KVEngine(load_model("smollm2-135m"), store)
    nodes = [TextNode(id_=d.id, text=d.text, metadata={"title": d.title}) for d in sample_docs()]

    # The swap: KVRetriever around your retriever (here kvrag's small index) and KVSynthesizer with KVRagLLM.
    retriever = KVRetriever.from_defaults(engine, nodes=nodes, similarity_top_k=1)
    llm = KVRagLLM(engine=engine, max_new_tokens=32)
    query_engine = RetrieverQueryEngine(retriever=retriever, response_synthesizer=KVSynthesizer(llm))

    rows = []
    for q in sample_questions()[:questions]:
        response = query_engine.query(q.question)
        receipt = response.metadata["kvrag_receipt"]
        # Plain text RAG beside it: the same nodes, re-read as text in the same segments.
        text = engine.generate(q.question, states=[n.node.get_content() for n in response.source_nodes], max_new_tokens=32, graft=False)
        rows.append({"question": q.question, "answer": str(response), "text_answer": text.text,
                     "mode": receipt["mode"], "text_mode": text.receipt.mode})
        print(f"Q: {q.question}\nA: {response}\n   {receipt['mode']} {receipt['timings']['ttft_ms']:.0f} ms | plain text: "
              f"{text.receipt.mode} {text.receipt.timings.ttft_ms:.0f} ms, same answer: {str(response) == text.text}\n")
    return rows


if __name__ == "__main__":
    main()
