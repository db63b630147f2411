"""A LangChain RAG pipeline on vLLM's OpenAI server, with kvrag's connector behind it: documents
deposited ahead of questions, so the first question over a document loads its blocks.

    python examples/langchain_on_vllm.py http://127.0.0.1:8000/v1 MODEL

`vllm serve` runs with the kvrag connector (see the vLLM guide). `deposit` sends, per document,
the prompt the pipeline will send, up to where the question begins, for one token: vLLM reads it,
and the connector saves its full blocks in kvrag's store. `ask` is the pipeline as LangChain's
tutorial writes it, with `ChatOpenAI` pointed at vLLM.
"""

from __future__ import annotations

import sys

from langchain_community.retrievers import BM25Retriever
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_openai import ChatOpenAI

from kvrag.data import sample_docs

PROMPT = ChatPromptTemplate.from_template("Answer the question based only on the following context:\n"
                                          "{context}\n\nQuestion: {question}\n")


def documents() -> list[Document]:
    return [Document(page_content=d.text, metadata={"title": d.title}) for d in sample_docs()]


def llm(base_url: str, model: str, max_tokens: int = 32) -> ChatOpenAI:
    return ChatOpenAI(base_url=base_url, api_key="-", model=model, temperature=0, max_tokens=max_tokens)


def deposit(base_url: str, model: str, docs: list[Document]) -> None:
    """Each document as the pipeline's prompt will hold it, with no question yet, for one token."""
    reader = PROMPT | llm(base_url, model, max_tokens=1)
    for doc in docs:
        reader.invoke({"context": doc.page_content, "question": ""})


def ask(base_url: str, model: str, question: str) -> str:
    retriever = BM25Retriever.from_documents(documents(), k=1)
    chain = ({"context": retriever | (lambda docs: "\n\n".join(d.page_content for d in docs)),
              "question": RunnablePassthrough()}
             | PROMPT | llm(base_url, model) | StrOutputParser())
    return chain.invoke(question)


if __name__ == "__main__":
    url, name = sys.argv[1], sys.argv[2]
    deposit(url, name, documents())
    print(ask(url, name, "Who built the lighthouse at Varrow Point?"))
