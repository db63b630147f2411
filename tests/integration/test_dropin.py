"""The pipelines people already have, unchanged but for the model, on smollm2-135m: LangChain's
standard RAG chain and LlamaIndex's default query and chat engines graft from the second ask with
the same documents (from the first when a prompt that begins alike came before), say so in their
receipts, and answer exactly as the same pipeline reading text."""

from __future__ import annotations

import asyncio
import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from langchain_community.retrievers import BM25Retriever
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_kvrag import ChatKVRAG
from llama_index.core import Document as LlamaDocument
from llama_index.core import Settings, VectorStoreIndex
from llama_index.core.chat_engine import CondensePlusContextChatEngine
from llama_index.core.embeddings import BaseEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.llms.kvrag import KVRagLLM

from kvrag import KVEngine, MemoryStore
from kvrag.data import sample_docs

pytestmark = pytest.mark.slow

TEMPLATE = """Answer the question based only on the following context:
{context}

Question: {question}
"""
QUESTION = "Who built the lighthouse at Varrow Point?"
REPHRASED = "Who built the Varrow Point lighthouse, and when?"
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def engine(smollm2):
    return KVEngine(smollm2, MemoryStore())


# ---------------------------------------------------------------- LangChain
class LangChainReceipts(BaseCallbackHandler):
    def __init__(self) -> None:
        self.receipts: list[dict] = []

    def on_llm_end(self, response, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.receipts.append(response.generations[0][0].message.response_metadata["kvrag_receipt"])


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


def rag_chain(retriever, llm):  # type: ignore[no-untyped-def]
    """LangChain's tutorial chain, exactly."""
    prompt = ChatPromptTemplate.from_template(TEMPLATE)
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()


@pytest.fixture(scope="module")
def lc_documents():
    return [Document(page_content=d.text, metadata={"title": d.title}, id=d.id) for d in sample_docs()]


def test_langchain_rag_chain_with_bm25_grafts_sync_async_stream_and_batch(engine, lc_documents):
    retriever = BM25Retriever.from_documents(lc_documents, k=2)
    chain = rag_chain(retriever, ChatKVRAG(engine=engine, max_tokens=16))
    text_chain = rag_chain(retriever, ChatKVRAG(engine=engine, max_tokens=16, graft=False))
    seen = LangChainReceipts()
    config = {"callbacks": [seen]}

    first = chain.invoke(QUESTION, config=config)
    second = chain.invoke(QUESTION, config=config)
    text = text_chain.invoke(QUESTION, config=config)
    assert [r["mode"] for r in seen.receipts] == ["text-prefill", "exact-graft", "text-prefill"]
    assert first == second == text and "Quill" in first
    assert len({r["first_token_logits_sha256"] for r in seen.receipts}) == 1

    seen.receipts.clear()
    streamed = "".join(chain.stream(QUESTION, config=config))
    awaited = asyncio.run(chain.ainvoke(QUESTION, config=config))

    async def astreamed() -> str:
        return "".join([chunk async for chunk in chain.astream(QUESTION, config=config)])

    async_streamed = asyncio.run(astreamed())
    batch = chain.batch([QUESTION, REPHRASED], config=config)
    text_rephrased = text_chain.invoke(REPHRASED)
    assert streamed == awaited == async_streamed == batch[0] == text
    assert batch[1] == text_rephrased
    modes = [r["mode"] for r in seen.receipts]
    assert modes[:4] == ["exact-graft"] * 4
    # The rephrased question retrieves the same documents: the context grafts on its first ask.
    assert retriever.invoke(REPHRASED) == retriever.invoke(QUESTION)
    rephrased = seen.receipts[4]
    assert rephrased["mode"] in ("exact-graft", "partial-graft") and rephrased["tokens_reused"] > 400


def test_langchain_rag_chain_with_a_vector_store_retriever_grafts(engine, lc_documents):
    store = InMemoryVectorStore.from_documents(lc_documents, DeterministicFakeEmbedding(size=64))
    retriever = store.as_retriever(search_kwargs={"k": 2})
    chain = rag_chain(retriever, ChatKVRAG(engine=engine, max_tokens=8))
    seen = LangChainReceipts()
    answers = [chain.invoke("How many steps lead to the lantern room?", config={"callbacks": [seen]}) for _ in range(2)]
    text = rag_chain(retriever, ChatKVRAG(engine=engine, max_tokens=8, graft=False)).invoke(
        "How many steps lead to the lantern room?")
    assert seen.receipts[1]["mode"] == "exact-graft" and seen.receipts[1]["tokens_reused"] > 300
    assert answers[0] == answers[1] == text


def test_a_langchain_conversation_grafts_its_earlier_turns(engine):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    llm, text_llm = ChatKVRAG(engine=engine, max_tokens=10), ChatKVRAG(engine=engine, max_tokens=10, graft=False)
    history = [SystemMessage("You answer in one short sentence."), HumanMessage(sample_docs()[0].text[:600])]
    for follow_up in ["Who built it?", "How tall is it?"]:
        reply = llm.invoke(history)
        assert reply.content == text_llm.invoke(history).content
        history += [AIMessage(reply.content), HumanMessage(follow_up)]
    third = llm.invoke(history)
    receipt = third.response_metadata["kvrag_receipt"]
    assert receipt["mode"] == "exact-graft" and receipt["tokens_prefilled"] < 20  # only the new message
    assert third.content == text_llm.invoke(history).content


# ---------------------------------------------------------------- LlamaIndex
class HashingEmbedding(BaseEmbedding):
    """Hashed bag of words: a deterministic, offline embedding model."""

    def _vector(self, text: str) -> list[float]:
        vector = [0.0] * 128
        for word in re.findall(r"\w+", text.lower()):
            vector[int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "big") % 128] += 1.0
        norm = sum(v * v for v in vector) ** 0.5 or 1.0
        return [v / norm for v in vector]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vector(text)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)


class LlamaReceipts(BaseEventHandler):
    receipts: list = []

    def handle(self, event, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.receipts.append(event.response.additional_kwargs.get("kvrag_receipt"))


@pytest.fixture
def llama_receipts():
    handler = LlamaReceipts(receipts=[])
    get_dispatcher().add_event_handler(handler)
    yield handler.receipts
    get_dispatcher().event_handlers.remove(handler)


@pytest.fixture(scope="module")
def index():
    documents = [LlamaDocument(text=d.text, metadata={"title": d.title}, id_=d.id) for d in sample_docs()]
    return VectorStoreIndex.from_documents(documents, embed_model=HashingEmbedding())


def _graft_then_text(make_engine, engine, receipts, question=QUESTION):  # type: ignore[no-untyped-def]
    kv, text = make_engine(KVRagLLM(engine=engine, max_new_tokens=10)), make_engine(
        KVRagLLM(engine=engine, max_new_tokens=10, graft=False))
    first = str(kv.query(question))
    receipts.clear()
    second = str(kv.query(question))
    grafted = list(receipts)
    assert grafted and all(r["mode"] == "exact-graft" and r["tokens_reused"] > 0 for r in grafted)
    assert first == second == str(text.query(question))
    return second


@pytest.mark.parametrize("mode", ["compact", "refine", "simple_summarize", "tree_summarize"])
def test_llamaindex_default_query_engine_grafts_in_every_response_mode(engine, index, llama_receipts, mode):
    _graft_then_text(lambda llm: index.as_query_engine(llm=llm, response_mode=mode, similarity_top_k=2), engine,
                     llama_receipts)


def test_llamaindex_retriever_query_engine_from_args_async_and_streaming(engine, index, llama_receipts):
    retriever = index.as_retriever(similarity_top_k=2)
    answer = _graft_then_text(lambda llm: RetrieverQueryEngine.from_args(retriever, llm=llm), engine, llama_receipts,
                              "How many steps lead to the lantern room?")
    llm = KVRagLLM(engine=engine, max_new_tokens=10)
    llama_receipts.clear()
    awaited = asyncio.run(RetrieverQueryEngine.from_args(retriever, llm=llm).aquery("How many steps lead to the lantern room?"))
    streaming = RetrieverQueryEngine.from_args(retriever, llm=llm, streaming=True).query("How many steps lead to the lantern room?")
    assert str(awaited) == "".join(streaming.response_gen) == answer
    assert [r["mode"] for r in llama_receipts if r] == ["exact-graft", "exact-graft"]


def test_llamaindex_chat_engine_grafts_the_earlier_turn(engine, index, llama_receipts):
    def conversation(llm):  # type: ignore[no-untyped-def]
        chat = CondensePlusContextChatEngine.from_defaults(index.as_retriever(similarity_top_k=1), llm=llm)
        return [str(chat.chat(m)) for m in (QUESTION, "What was the tower made of?")]

    kv = conversation(KVRagLLM(engine=engine, max_new_tokens=10))
    turn_two = [r for r in llama_receipts if r][-1]
    assert turn_two["tokens_reused"] > 0 and turn_two["mode"] in ("exact-graft", "partial-graft")
    assert kv == conversation(KVRagLLM(engine=engine, max_new_tokens=10, graft=False))


def test_settings_llm_works_with_no_openai_key(smollm2, llama_receipts, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setattr(Settings, "_llm", KVRagLLM(engine=KVEngine(smollm2, MemoryStore()), max_new_tokens=8))
    monkeypatch.setattr(Settings, "_embed_model", HashingEmbedding())
    documents = [LlamaDocument(text=d.text, id_=d.id) for d in sample_docs()[:4]]
    query_engine = VectorStoreIndex.from_documents(documents).as_query_engine(similarity_top_k=1)
    answers = [str(query_engine.query(QUESTION)) for _ in range(2)]
    assert answers[0] == answers[1] and [r["mode"] for r in llama_receipts] == ["text-prefill", "exact-graft"]


# ---------------------------------------------------------------- examples, in fresh processes
INTEGRATIONS = ["langchain-kvrag", "llama-index-retrievers-kvrag", "llama-index-llms-kvrag"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The three integration distributions built and installed (not editable) into a folder of their own."""
    target = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--target", str(target), *[str(ROOT / "integrations" / name) for name in INTEGRATIONS]],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return target


@pytest.mark.parametrize("example", ["langchain_dropin", "llamaindex_dropin"])
def test_the_dropin_examples_run_on_the_installed_distributions_and_graft_on_the_second_ask(installed, example):
    code = (
        "import langchain_kvrag, llama_index.llms.kvrag as l, llama_index.retrievers.kvrag as r, runpy, sys; "
        f"assert all(m.__file__.startswith({str(installed)!r}) for m in (langchain_kvrag, l, r)); "
        f"rows = runpy.run_path('examples/{example}.py')['main'](questions=1); "
        "assert all(r['mode'] == 'exact-graft' and r['answer'] == r['again'] for r in rows), rows"
    )
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONPATH": str(installed)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "asked again: exact-graft" in done.stdout
