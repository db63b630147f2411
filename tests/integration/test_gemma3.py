"""The second real model: Gemma 3 270M (base, no chat template; five 512-token sliding-window layers
to each global one), embedded from its PyPI package. Documents and chains longer than the window
graft exactly against stock transformers calls; the invariant kernel equals one stock pass; drop-in
completion pipelines (a LangChain `PromptTemplate` into a base LLM, a LlamaIndex query engine on
the base model) graft what they read before."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvrag import KVEngine, MemoryStore, load_model
from kvrag.artifacts.format import encode_payload, parse_manifest, sha256_hex
from kvrag.codecs import extract
from kvrag.core.runner import logits_sha256
from kvrag.data import sample_docs

from ..conftest import first_token_sha_at_threads

pytestmark = pytest.mark.slow

QUESTION = "Who built the lighthouse at Varrow Point?"


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_invariant():
    return load_model("gemma3-270m", attn="invariant")


@pytest.fixture(scope="module")
def engine(gemma):
    return KVEngine(gemma, MemoryStore())


def _docs() -> list[str]:
    return [d.text for d in sample_docs()]


def _long_document(tokenizer, at_least: int = 700) -> str:
    """Whole bundled documents joined until they are longer than `at_least` tokens."""
    parts: list[str] = []
    for text in _docs():
        parts.append(text)
        if len(tokenizer("\n".join(parts))["input_ids"]) > at_least:
            return "\n".join(parts)
    raise AssertionError("the bundled documents are too short")


def _stock_logits(model, pieces: list[list[int]]) -> torch.Tensor:
    """The same schedule by stock transformers calls only: one forward per piece, one DynamicCache."""
    cache = DynamicCache(config=model.hf_model.config)
    with torch.inference_mode():
        for ids in pieces:
            out = model.hf_model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


def test_gemma3_is_embedded_as_a_base_model_with_sliding_windows(gemma, engine):
    config = gemma.config
    assert type(gemma.hf_model).__name__ == "Gemma3ForCausalLM" and config.num_hidden_layers == 18
    assert config.sliding_window == 512
    assert config.layer_types.count("sliding_attention") == 15 and config.layer_types[5] == "full_attention"
    assert not gemma.tokenizer.chat_template
    assert engine.layout.kind == "completion" and engine.layout.prefix_ids[0] == gemma.tokenizer.bos_token_id


def test_a_document_longer_than_the_window_grafts_exactly(gemma, engine):
    document = _long_document(gemma.tokenizer)
    ref = engine.deposit(document)
    assert ref.token_count > 512
    manifest = parse_manifest(engine.store.read_manifest(ref.key))
    sliding = [entry for entry in manifest.layers if entry.kind == "sliding"]
    full = [entry for entry in manifest.layers if entry.kind == "full"]
    assert len(sliding) == 15 and len(full) == 3
    assert all(entry.window == 512 and entry.length == 511 for entry in sliding)  # only the window is held
    assert all(entry.length == ref.token_count for entry in full)
    graft = engine.generate(QUESTION, states=[ref], max_new_tokens=28)
    assert graft.receipt.mode == "exact-graft" and graft.receipt.layout == "completion"
    segment = engine.plan([document])[0]
    stock = _stock_logits(gemma, [segment.ids, engine.layout.question_ids(QUESTION)])
    assert graft.receipt.first_token_logits_sha256 == logits_sha256(stock)
    text = engine.generate(QUESTION, states=[document], max_new_tokens=28, graft=False)
    assert text.text == graft.text and "Mara Quill" in graft.text and "\n" not in graft.text


def test_a_three_document_chain_crossing_the_window_equals_from_scratch(gemma, engine):
    documents = _docs()[1:4]
    refs = engine.deposit_chain(documents)
    assert refs[-1].end > 512 and refs[0].end < 512  # the later states' windows reach into their parents
    cache = DynamicCache(config=gemma.hf_model.config)
    segments = engine.plan(documents)
    for segment in segments:  # every stored state = the bytes a from-scratch stock run holds there
        with torch.inference_mode():
            gemma.hf_model(input_ids=torch.tensor([segment.ids]), cache=cache, use_cache=True, logits_to_keep=1)
        _, tensors = extract(engine.runner.codecs, cache, segment.start, segment.end)
        stored = parse_manifest(engine.store.read_manifest(segment.key))
        assert sha256_hex(encode_payload(tensors)) == stored.payload_sha256
    question = "How many steps lead to the lantern room?"
    graft = engine.generate(question, states=refs, max_new_tokens=1)
    assert graft.receipt.mode == "exact-graft"
    stock = _stock_logits(gemma, [*(s.ids for s in segments), engine.layout.question_ids(question)])
    assert graft.receipt.first_token_logits_sha256 == logits_sha256(stock)


def test_the_invariant_kernel_equals_one_stock_pass_past_the_window(gemma_invariant):
    model = gemma_invariant
    engine = KVEngine(model, MemoryStore())
    documents = [_long_document(model.tokenizer, 560)]
    ref = engine.deposit(documents[0])
    graft = engine.generate(QUESTION, states=[ref], max_new_tokens=1)
    assert graft.receipt.mode == "exact-graft"
    ids = [*engine.plan(documents)[0].ids, *engine.layout.question_ids(QUESTION)]
    with torch.inference_mode():  # one ordinary forward over the whole prompt
        stock = model.hf_model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
    assert graft.receipt.first_token_logits_sha256 == logits_sha256(stock)


def test_the_invariant_kernel_gives_the_same_bits_at_1_and_2_threads(gemma_invariant):
    """What lets the hardware fingerprint leave the thread count out under this kernel, on gemma3-270m."""
    shas = first_token_sha_at_threads(gemma_invariant, _docs()[:2], QUESTION)
    assert shas[0] == shas[1]


def test_a_langchain_prompt_template_into_the_base_llm_grafts_the_second_time(gemma, engine):
    from langchain_community.retrievers import BM25Retriever
    from langchain_core.documents import Document
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import PromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_kvrag import KVRagLLM

    retriever = BM25Retriever.from_documents([Document(page_content=t) for t in _docs()], k=2)
    prompt = PromptTemplate.from_template("{context}\n\nQuestion: {question}\nAnswer:")
    receipts: list[dict] = []

    def chain(llm):  # type: ignore[no-untyped-def]
        context = retriever | (lambda docs: "\n\n".join(d.page_content for d in docs))
        return {"context": context, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()

    llm = KVRagLLM(engine=engine, max_tokens=20, stop=["\n"])
    first = chain(llm).invoke(QUESTION)
    result = llm.generate([prompt.format(context="\n\n".join(d.page_content for d in retriever.invoke(QUESTION)),
                                         question=QUESTION)])
    receipts.append(result.generations[0][0].generation_info["kvrag_receipt"])
    assert receipts[0]["mode"] == "exact-graft" and receipts[0]["layout"] == "prompt"
    assert result.generations[0][0].text == first and "Mara Quill" in first
    text_arm = chain(KVRagLLM(engine=engine, max_tokens=20, stop=["\n"], graft=False)).invoke(QUESTION)
    assert text_arm == first
    assert "".join(chain(llm).stream(QUESTION)) == first


def test_a_llamaindex_query_engine_on_the_base_model_grafts_the_second_time(engine):
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMCompletionEndEvent
    from llama_index.llms.kvrag import KVRagLLM

    from .test_dropin import HashingEmbedding

    class Receipts(BaseEventHandler):
        receipts: list = []

        def handle(self, event, **kwargs) -> None:  # type: ignore[no-untyped-def]
            if isinstance(event, LLMCompletionEndEvent) and event.response is not None:
                self.receipts.append(event.response.additional_kwargs.get("kvrag_receipt"))

    handler = Receipts(receipts=[])
    get_dispatcher().add_event_handler(handler)
    try:
        index = VectorStoreIndex.from_documents([Document(text=t) for t in _docs()], embed_model=HashingEmbedding())
        llm = KVRagLLM(engine=engine, max_new_tokens=10)
        assert llm.metadata.is_chat_model is False  # LlamaIndex sends a base model completion prompts
        query_engine = index.as_query_engine(llm=llm, similarity_top_k=2)
        first = str(query_engine.query(QUESTION))
        handler.receipts.clear()
        second = str(query_engine.query(QUESTION))
        assert handler.receipts and all(r["mode"] == "exact-graft" and r["layout"] == "prompt" for r in handler.receipts)
        text = index.as_query_engine(llm=KVRagLLM(engine=engine, max_new_tokens=10, graft=False), similarity_top_k=2)
        assert first == second == str(text.query(QUESTION))
    finally:
        get_dispatcher().event_handlers.remove(handler)


def test_a_packed_decoding_step_equals_each_step_alone_past_the_window(gemma_invariant):
    """Continuous batching's forward (`ModelRunner.step_many`) over sliding-window layers."""
    from kvrag.core.prefill import Prefill
    from kvrag.core.runner import DecodeStep, ModelRunner

    runner = ModelRunner(gemma_invariant)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(300, 20000, (n,), generator=generator).tolist() for n in (40, 700)]

    def prefilled(prompt):
        run = Prefill(runner)
        return run, run.text(prompt)

    alone = []
    for prompt in prompts:
        run, logits = prefilled(prompt)
        shas = []
        for _ in range(5):
            logits = runner.step(int(logits.argmax()), run.cache)
            shas.append(logits_sha256(logits))
        alone.append(shas)
    runs = [prefilled(prompt) for prompt in prompts]
    tokens = [int(logits.argmax()) for _, logits in runs]
    packed: list[list[str]] = [[], []]
    for step in range(5):
        outs = runner.step_many([DecodeStep(token, len(prompt) + step, run.cache)
                                 for token, prompt, (run, _) in zip(tokens, prompts, runs)])
        for shas, out in zip(packed, outs):
            shas.append(logits_sha256(out))
        tokens = [int(out.argmax()) for out in outs]
    assert runner.batches_exactly
    assert packed == alone
