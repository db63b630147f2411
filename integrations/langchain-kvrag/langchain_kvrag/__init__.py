"""kvrag for LangChain: a retriever that returns verified KV states, and a chat model that grafts them.

    from langchain_kvrag import ChatKVRAG, KVRetriever, create_kv_rag_chain

    retriever = KVRetriever(engine=engine, retriever=my_vectorstore.as_retriever(), k=2)
    chain = create_kv_rag_chain(retriever, ChatKVRAG(engine=engine))
    answer = chain.invoke("Who built the lighthouse?")
    answer.response_metadata["kvrag_receipt"]["mode"]     # 'exact-graft' once deposited

For a base model (no chat template), `KVRagLLM` is the text-completion model a `PromptTemplate`
pipes into: `(prompt | KVRagLLM(model="gemma3-270m")).invoke({...})`.
"""

from langchain_kvrag.cache import KVCache
from langchain_kvrag.chains import create_kv_rag_chain, state_blocks
from langchain_kvrag.chat_models import ChatKVRAG
from langchain_kvrag.llms import KVRagLLM
from langchain_kvrag.retrievers import STATE_KEY, KVRetriever

__all__ = ["KVRetriever", "ChatKVRAG", "KVRagLLM", "KVCache", "create_kv_rag_chain", "state_blocks", "STATE_KEY"]
