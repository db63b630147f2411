"""kvrag around the retrievers you already have, offline: LangChain's BM25 and LlamaIndex's keyword index.

    python examples/wrap_retrievers.py

`KVRetriever` (one per framework) returns what your retriever returns, each document deposited on
first sight and stamped with its verified state's key; kvrag's chain and synthesizer pass those
keys on, so a retrieved document grafts from the first question (with several per question, the first
grafts and the others are read after it until their chain is stored: see the docs' "several
documents per question"). Needs `pip install "langchain-kvrag[examples]"`.
"""

from __future__ import annotations

from langchain_community.retrievers import BM25Retriever
from langchain_core.documents import Document
from langchain_kvrag import ChatKVRAG, create_kv_rag_chain
from langchain_kvrag import KVRetriever as LangChainKVRetriever
from llama_index.core import Document as LlamaDocument
from llama_index.core import SimpleKeywordTableIndex
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.llms.kvrag import KVRagLLM, KVSynthesizer
from llama_index.retrievers.kvrag import KVRetriever as LlamaIndexKVRetriever

from kvrag import KVEngine
from kvrag.data import sample_docs

QUESTION = "Who built the lighthouse at Varrow Point?"


def main(model: str = "smollm2-135m") -> dict:
    engine = KVEngine.open(model, "memory://")
    texts = [d.text for d in sample_docs()]

    bm25 = BM25Retriever.from_documents([Document(page_content=t) for t in texts], k=1)   # yours
    langchain = create_kv_rag_chain(LangChainKVRetriever(engine=engine, retriever=bm25, k=1),
                                    ChatKVRAG(engine=engine, max_tokens=24))
    lc = langchain.invoke(QUESTION)
    print("LangChain:", lc.response_metadata["kvrag_receipt"]["mode"], lc.text)

    keywords = SimpleKeywordTableIndex.from_documents([LlamaDocument(text=t) for t in texts],
                                                      llm=KVRagLLM(engine=engine)).as_retriever()   # yours
    llama = RetrieverQueryEngine(retriever=LlamaIndexKVRetriever(engine, retriever=keywords, similarity_top_k=1),
                                 response_synthesizer=KVSynthesizer(KVRagLLM(engine=engine, max_new_tokens=24)))
    li = llama.query(QUESTION)
    print("LlamaIndex:", li.metadata["kvrag_receipt"]["mode"], li)
    return {"langchain": lc.response_metadata["kvrag_receipt"]["mode"], "llamaindex": li.metadata["kvrag_receipt"]["mode"]}


if __name__ == "__main__":
    main()
