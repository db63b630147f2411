"""`KVRagLLM`, LangChain's text-completion model: a `PromptTemplate` piped into it continues the
formatted prompt as given, grafts what an earlier prompt read, and carries the receipt."""

from __future__ import annotations

from langchain_core.language_models import BaseLLM
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_kvrag import KVRagLLM

from kvrag import KVEngine, MemoryStore

from ..conftest import QUESTION, tiny

CONTEXT = ("The lighthouse at Varrow Point was built in 1871 by the engineer Mara Quill.\n"
           "Its first lamp burned whale oil and could be seen far out at sea.\n")


def test_a_prompt_template_into_kvrag_llm_grafts_the_second_time():
    engine = KVEngine(tiny("llama"), MemoryStore(), layout="completion")  # as for a base model
    llm = KVRagLLM(engine=engine, max_tokens=4)
    assert isinstance(llm, BaseLLM)
    prompt = PromptTemplate.from_template("{context}\nQuestion: {question}\nAnswer:")
    chain = prompt | llm | StrOutputParser()
    first = chain.invoke({"context": CONTEXT, "question": QUESTION})
    result = llm.generate([prompt.format(context=CONTEXT, question=QUESTION)])
    receipt = result.generations[0][0].generation_info["kvrag_receipt"]
    assert receipt["layout"] == "prompt" and receipt["tokens_reused"] > 0
    assert result.generations[0][0].text == first
    assert "".join(chain.stream({"context": CONTEXT, "question": QUESTION})) == first
    assert chain.batch([{"context": CONTEXT, "question": QUESTION}] * 2) == [first, first]
    text = (prompt | KVRagLLM(engine=engine, max_tokens=4, graft=False) | StrOutputParser()).invoke(
        {"context": CONTEXT, "question": QUESTION})
    assert text == first
