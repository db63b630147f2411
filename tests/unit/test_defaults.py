"""Where users are, the same policy: the LangChain and LlamaIndex adapters, `kvrag serve` and
`kvrag ab` (its default, lazy policy) answer with the same reuse defaults, `kvrag.core.RAG_DEFAULTS`;
and the `order` setting reads documents in the order it names, a graft and a re-read alike."""

from __future__ import annotations

import inspect

import pytest
from langchain_kvrag import ChatKVRAG
from langchain_kvrag import KVRagLLM as LangChainLLM
from llama_index.llms.kvrag import KVRagLLM as LlamaIndexLLM

from kvrag import InputError, KVEngine, MemoryStore
from kvrag.apps.ab import run_ab
from kvrag.cli.ab import ab
from kvrag.core import RAG_DEFAULTS
from kvrag.reuse.levers import canonical_order
from kvrag.server.protocol import ChatRequest, CompletionRequest
from tests.conftest import DOC_A, DOC_B, DOC_C, QUESTION, tiny

POLICY = ("deposit_missing", "admit_after", "deposit_in_background", "memo", "graft", "order")


def policy(options) -> dict[str, object]:
    return {name: getattr(options, name) for name in POLICY}


def test_the_adapters_the_server_and_kvrag_ab_share_one_set_of_defaults():
    expected = policy(RAG_DEFAULTS)
    assert expected == {"deposit_missing": True, "admit_after": 1, "deposit_in_background": True, "memo": True, "graft": True,
                        "order": "retrieval"}
    engine = KVEngine(tiny("llama"), MemoryStore())
    assert policy(ChatKVRAG(engine=engine)._options(None, {})) == expected
    assert policy(LangChainLLM(engine=engine)._options(None, {})) == expected
    assert policy(LlamaIndexLLM(engine=engine).options()) == expected
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert policy(chat.options(16)) == expected
    assert policy(CompletionRequest(model="m", prompt="hi").options(16)) == expected
    # kvrag ab (API and command): lazy deposits what its KV arm read as text, in retrieval order
    run = inspect.signature(run_ab).parameters
    command = inspect.signature(ab).parameters
    assert run["policy"].default == command["policy"].default.default == "lazy"
    assert run["order"].default == command["order"].default.default == expected["order"]
    assert run["admit_after"].default == command["admit_after"].default.default == expected["admit_after"]


def test_a_chain_is_deposited_from_its_admit_after_th_reading_as_text_on():
    engine = KVEngine(tiny("llama"), MemoryStore())
    docs = [DOC_A, DOC_B]
    modes = [engine.generate(QUESTION, states=docs, max_new_tokens=2, memo=False, deposit_missing=True, admit_after=3).receipt.mode
             for _ in range(4)]
    assert modes == ["text-prefill", "text-prefill", "text-prefill", "exact-graft"]
    assert engine.admission.count(engine.plan(docs)) == 3
    with pytest.raises(InputError, match="admit_after"):
        engine.generate(QUESTION, states=docs, admit_after=0)


@pytest.mark.parametrize("order", ["canonical", "stored-first"])
def test_an_order_reads_the_documents_in_that_order_grafted_or_not(order):
    engine = KVEngine(tiny("llama"), MemoryStore())
    retrieved = list(reversed(canonical_order([DOC_A, DOC_B, DOC_C]))) if order == "canonical" else [DOC_C, DOC_A, DOC_B]
    engine.deposit_chain([DOC_B, DOC_C])
    expected = canonical_order(retrieved) if order == "canonical" else [DOC_B, DOC_C, DOC_A]
    assert expected != retrieved
    kv = engine.generate(QUESTION, states=retrieved, max_new_tokens=2, order=order, memo=False)
    text = engine.generate(QUESTION, states=expected, max_new_tokens=2, graft=False, memo=False)
    reread = engine.generate(QUESTION, states=retrieved, max_new_tokens=2, graft=False, memo=False, order=order)
    assert kv.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256
    assert reread.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256
    if order == "stored-first":
        assert kv.receipt.tokens_reused > 0
    with pytest.raises(InputError, match="order"):
        engine.generate(QUESTION, states=retrieved, order="alphabetical")  # type: ignore[arg-type]
