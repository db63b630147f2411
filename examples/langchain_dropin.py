"""LangChain's own RAG chain, as its tutorial writes it, with one line changed: the chat model.

    python examples/langchain_dropin.py

Everything below is LangChain's tutorial chain (a BM25 retriever over your documents, a prompt
template, `format_docs`, an output parser). The one change is the `llm = ...` line: `ChatKVRAG`
instead of a hosted chat model. Nothing else knows about kvrag: the formatted prompt is rendered
with the model's chat template, and every part of it already stored as a verified state (the
template's opening, the same documents, the earlier turns) is grafted instead of re-read. The first
ask over some documents reads them and deposits their states; the next ask that begins alike
grafts them. Each answer's receipt is in `response_metadata["kvrag_receipt"]` (before the parser).
"""

from __future__ import annotations

from langchain_community.retrievers import BM25Retriever
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_kvrag import ChatKVRAG

from kvrag.data import sample_docs, sample_questions

documents = [Document(page_content=d.text, metadata={"title": d.title}, id=d.id) for d in sample_docs()]
retriever = BM25Retriever.from_documents(documents, k=2)

template = """Answer the question based only on the following context:
{context}

Question: {question}
"""
prompt = ChatPromptTemplate.from_template(template)


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


llm = ChatKVRAG(model="smollm2-135m", max_tokens=32)  # the one line: was ChatOpenAI(model="gpt-4o-mini")

rag_chain = (
    {"context": retriever | format_docs, "question": RunnablePassthrough()}
    | prompt
    | llm
    | StrOutputParser()
)


def main(questions: int = 3) -> list[dict]:
    """Each question twice through the unchanged chain: the second ask grafts what the first read."""
    receipts = (
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
        | prompt
        | llm
    )  # the same chain without the parser, to show the receipt
    rows = []
    for q in sample_questions()[:questions]:
        answer = rag_chain.invoke(q.question)
        again = receipts.invoke(q.question)
        receipt = again.response_metadata["kvrag_receipt"]
        rows.append({"question": q.question, "answer": answer, "again": again.text, "mode": receipt["mode"],
                     "tokens_reused": receipt["tokens_reused"], "tokens_prefilled": receipt["tokens_prefilled"]})
        print(f"Q: {q.question}\nA: {answer}\n   asked again: {receipt['mode']}, {receipt['tokens_reused']} tokens "
              f"grafted, {receipt['tokens_prefilled']} read, same answer: {again.text == answer}\n")
    return rows


if __name__ == "__main__":
    main()
