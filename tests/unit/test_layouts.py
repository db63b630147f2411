"""Prompt layouts: a base model (no chat template) gets the completion layout, its own begin-of-text
token first, an answer that ends at its line, raw completion prompts read as a stock
`tokenizer(prompt)` reads them, and chat messages in a documented plain form; the layout is named
in receipts and manifests and is part of every state's key. Tiny models with the template removed
stand in for a base model (the real one, gemma3-270m: tests/integration/test_gemma3.py)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from tokenizers import processors

from kvrag import KVEngine, MemoryStore
from kvrag.artifacts.format import parse_manifest
from kvrag.core.prompt import PromptLayout, bos_ids
from kvrag.core.transcript import messages_of
from kvrag.errors import InputError

from ..conftest import DOC_A, DOC_B, QUESTION, tiny


def base_model(family: str = "llama"):
    """A tiny model whose tokenizer has no chat template and puts a begin-of-text token first, as
    Gemma's does."""
    model = tiny(family)
    tokenizer = copy.deepcopy(model.tokenizer)
    tokenizer.chat_template = None
    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, bos)])
    loaded = dataclasses.replace(model, tokenizer=tokenizer, _memo={})
    loaded.__dict__.pop("fingerprint", None)
    return loaded


def test_a_model_without_a_chat_template_gets_the_completion_layout():
    model = base_model()
    tokenizer = model.tokenizer
    layout = PromptLayout.for_tokenizer(tokenizer)
    assert layout.kind == "completion" and layout.answer_stops == ("\n",)
    assert list(layout.prefix_ids[:1]) == bos_ids(tokenizer) == [tokenizer.bos_token_id]
    ids = [*layout.prefix_ids, *layout.document_ids(DOC_A), *layout.question_ids(QUESTION)]
    assert tokenizer.decode(ids[1:]).endswith(f"{DOC_A}\nQuestion: {QUESTION}\nAnswer:")
    # the joined ids are what a stock tokenizer(prompt) reads for the same text
    assert tokenizer(tokenizer.decode(ids[1:]))["input_ids"] == ids
    with pytest.raises(InputError, match="no chat template"):
        PromptLayout.for_tokenizer(tokenizer, kind="chat")
    assert PromptLayout.for_tokenizer(tiny("llama").tokenizer).kind == "chat"
    assert PromptLayout.for_tokenizer(tiny("llama").tokenizer, kind="completion").kind == "completion"


def test_the_layout_is_named_in_receipts_and_manifests_and_is_part_of_the_key():
    model = tiny("llama")
    chat, completion = KVEngine(model, MemoryStore()), KVEngine(model, MemoryStore(), layout="completion")
    chat_ref, completion_ref = chat.deposit(DOC_A), completion.deposit(DOC_A)
    assert chat_ref.key != completion_ref.key  # the same text, laid out otherwise: another state
    assert parse_manifest(chat.store.read_manifest(chat_ref.key)).prompt_layout == "chat"
    assert parse_manifest(completion.store.read_manifest(completion_ref.key)).prompt_layout == "completion"
    # second in a chain: the parent (whose prefix is the layout's) puts the layout in the key too
    assert chat.deposit(DOC_B, after=chat_ref).key != completion.deposit(DOC_B, after=completion_ref).key
    generation = completion.generate(QUESTION, states=[completion_ref], max_new_tokens=3)
    assert generation.receipt.layout == "completion" and generation.receipt.mode == "exact-graft"
    assert chat.generate(QUESTION, states=[chat_ref], max_new_tokens=3).receipt.layout == "chat"


def test_a_completion_answer_ends_where_the_layout_says_in_graft_and_text():
    engine = KVEngine(base_model(), MemoryStore())
    ref = engine.deposit(DOC_A)
    question = "When?"
    unstopped = engine.generate(question, states=[ref], max_new_tokens=24, stop=["\x00"]).text
    assert "\x1b" in unstopped  # what this random model writes; a trained one writes a newline
    engine.layout = dataclasses.replace(engine.layout, answer_stops=("\x1b",))
    graft = engine.generate(question, states=[ref], max_new_tokens=24)
    text = engine.generate(question, states=[DOC_A], max_new_tokens=24, graft=False)
    assert graft.text == text.text == unstopped.split("\x1b")[0].strip()
    assert graft.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256
    assert graft.receipt.mode == "exact-graft" and text.receipt.mode == "text-prefill"


def test_a_raw_completion_prompt_reads_as_a_stock_tokenizer_and_generate_would():
    model = base_model()
    engine = KVEngine(model, MemoryStore())
    prompt = f"Context:\n{DOC_A}\n{DOC_B}\n\nQuestion: {QUESTION}\nAnswer:"
    first = engine.complete(prompt, max_new_tokens=6, deposit_missing=True)
    assert first.receipt.layout == "prompt" and first.receipt.mode == "text-prefill"
    again = engine.complete(prompt, max_new_tokens=6)
    assert again.receipt.mode == "exact-graft" and again.receipt.tokens_reused > 0  # every segment before the last
    assert again.text == first.text
    assert again.receipt.first_token_logits_sha256 == first.receipt.first_token_logits_sha256
    ids = model.tokenizer(prompt)["input_ids"]
    assert ids[0] == model.tokenizer.bos_token_id
    assert again.receipt.tokens_reused + again.receipt.tokens_prefilled == len(ids)
    with torch.inference_mode():  # the same greedy tokens as stock generate (tiny float32 models: same argmax)
        out = model.hf_model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                      eos_token_id=sorted(engine.layout.stop_ids), pad_token_id=ids[0])
    assert again.tokens == [t for t in out[0, len(ids):].tolist() if t not in engine.layout.stop_ids][: len(again.tokens)]


def test_chat_messages_to_a_base_model_use_the_documented_plain_form():
    model = base_model()
    engine = KVEngine(model, MemoryStore())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    transcript = engine.renderer.render(messages_of(messages))
    assert transcript.ids[0] == model.tokenizer.bos_token_id
    assert model.tokenizer.decode(transcript.ids[1:]) == f"System: Be brief.\n\nUser: {QUESTION}\n\nAssistant:"
    generation = engine.chat(messages, max_new_tokens=8)
    assert generation.receipt.layout == "plain-chat" and "\nUser:" not in generation.text
    # a chat model's completion prompt is one user turn, rendered by its template
    chat_engine = KVEngine(tiny("llama"), MemoryStore())
    assert chat_engine.complete(QUESTION, max_new_tokens=2).receipt.layout == "chat-template"


def test_a_state_key_depends_on_the_layout_even_for_identical_documents():
    model = base_model()
    engine = KVEngine(model, MemoryStore())
    plain = KVEngine(model, MemoryStore(), system_prompt="Another system text.")
    assert engine.plan([DOC_A])[0].key != plain.plan([DOC_A])[0].key
    # the layout's prefix (begin-of-text, system text) opens the first segment
    assert engine.plan([DOC_A])[0].ids[: len(engine.layout.prefix_ids)] == list(engine.layout.prefix_ids)


def test_v1_completions_continues_a_base_models_prompt_as_given_and_grafts_it_next_time():
    from fastapi.testclient import TestClient

    from kvrag.server.app import ServeSettings, create_app

    model = base_model()
    engine = KVEngine(model, MemoryStore())
    prompt = f"{DOC_A}\n{DOC_B}\n\nQuestion: {QUESTION}\nAnswer:"
    with TestClient(create_app(ServeSettings(model="tiny-random-llama"), engine)) as http:
        body = {"model": "tiny-random-llama", "prompt": prompt, "max_tokens": 4}
        cold, warm = http.post("/v1/completions", json=body), http.post("/v1/completions", json=body)
    assert cold.status_code == warm.status_code == 200
    receipt = warm.json()["kvrag_receipt"]
    assert receipt["layout"] == "prompt" and receipt["tokens_reused"] > 0
    assert receipt["tokens_reused"] + receipt["tokens_prefilled"] == len(model.tokenizer(prompt)["input_ids"])
    assert warm.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]
    assert receipt["first_token_logits_sha256"] == cold.json()["kvrag_receipt"]["first_token_logits_sha256"]


def test_the_ab_harness_runs_the_stock_completion_arm_for_a_base_model():
    from kvrag.apps.ab import run_ab
    from kvrag.apps.ab.run import STOCK_COMPLETION

    docs = [{"id": "a", "text": DOC_A}, {"id": "b", "text": DOC_B}]
    questions = [{"id": "q", "question": QUESTION, "answers": ["Mara Quill"]}]
    summary = run_ab(KVEngine(base_model(), MemoryStore()), docs, questions, max_new_tokens=3)
    (row,) = summary.rows
    assert row.stock_answer is not None and row.stock_hit is not None and summary.accuracy_stock is not None
    assert "{documents}" in STOCK_COMPLETION and STOCK_COMPLETION.endswith("Answer:")
    chat = run_ab(KVEngine(tiny("llama"), MemoryStore()), docs, questions, max_new_tokens=3)
    assert chat.accuracy_stock is None and chat.rows[0].stock_answer is None  # a chat model: not run unless asked


def test_an_answer_that_opens_with_a_newline_has_not_ended():
    from kvrag.core.decoding import TextDecoder

    tokenizer = tiny("llama").tokenizer
    decoder = TextDecoder(tokenizer, frozenset(), ("\n",))
    deltas = []
    for token in tokenizer("\n Edric Hollow\nQuestion: next", add_special_tokens=False)["input_ids"]:
        deltas.extend(decoder.push(token))
    deltas.extend(decoder.flush())
    assert "".join(deltas) == "Edric Hollow" and decoder.done


def test_a_documents_ids_are_remembered_as_its_tokenizer_gives_them_and_bounded(monkeypatch):
    """The same retrieved documents come back question after question: their ids are remembered,
    equal to a fresh tokenization, never shared with a caller who changes them, and the memory is
    bounded by the characters it holds."""
    from kvrag.core import prompt

    monkeypatch.setattr(prompt._RecentIds, "MAX_CHARS", 400)
    layout = PromptLayout.for_tokenizer(tiny("llama").tokenizer)
    first = layout.document_ids(DOC_A)
    first.append(7)
    assert layout.document_ids(DOC_A) == list(layout.tokenizer(DOC_A.rstrip() + "\n", add_special_tokens=False)["input_ids"])
    for n in range(40):
        layout.document_ids(f"document number {n} " * 3)
    assert layout._documents._chars <= 400 and len(layout._documents._ids) < 40
    other = dataclasses.replace(layout, tokenizer=base_model().tokenizer)
    assert other._documents is not layout._documents
