"""Whole prompts (chat messages as frameworks format them): cut by content, grafted exactly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrag import InputError, KVEngine
from kvrag.core.transcript import MIN_SEGMENT_TOKENS, Message, Renderer, messages_of
from kvrag.errors import EmptyTextError
from tests.conftest import DOC_A, DOC_B, DOC_C, tiny

TOKENIZER = tiny("llama").tokenizer
WORDS = st.sampled_from(["the", "tower", "lamp", "keeper", "1871", "granite", "sea", "light", "Quill", "."])
LINES = st.lists(WORDS, min_size=1, max_size=12).map(" ".join)
TEXTS = st.lists(LINES, min_size=1, max_size=8).map("\n".join)


def rag_messages(question: str, documents: list[str], system: str = "Answer from the context.") -> list[Message]:
    context = "\n\n".join(documents)
    return messages_of([
        {"role": "system", "content": system},
        {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}\nAnswer:"},
    ])


@settings(max_examples=60, deadline=None)
@given(common=TEXTS, tail_a=TEXTS, tail_b=TEXTS)
def test_prompts_that_begin_alike_are_cut_alike_up_to_where_they_differ(common: str, tail_a: str, tail_b: str) -> None:
    renderer = Renderer(TOKENIZER, min_segment_tokens=8)
    a = renderer.render(messages_of([{"role": "user", "content": common + "\n" + tail_a}]))
    b = renderer.render(messages_of([{"role": "user", "content": common + "\n" + tail_b}]))
    for t in (a, b):
        assert [i for _, ids in t.pieces() for i in ids] == t.ids  # the pieces are the prompt, once
        assert all(ids for _, ids in t.pieces())
    shared = next((i for i, (x, y) in enumerate(zip(a.ids, b.ids)) if x != y), min(len(a.ids), len(b.ids)))
    assert [c for c in a.cuts if c < shared] == [c for c in b.cuts if c < shared]


def test_the_prompt_is_the_chat_templates_own_rendering_tokenized_once() -> None:
    messages = rag_messages("Who built it?", [DOC_A, DOC_B])
    transcript = Renderer(TOKENIZER).render(messages)
    plain = [m.model_dump() for m in messages]
    assert transcript.ids == TOKENIZER.apply_chat_template(plain, tokenize=True, add_generation_prompt=True,
                                                           return_dict=True)["input_ids"]


def test_every_message_end_but_the_last_is_a_cut_and_line_cuts_keep_their_distance() -> None:
    renderer = Renderer(TOKENIZER)
    messages = messages_of([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": DOC_A},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": DOC_B + "\n" + DOC_C + "\nWho built it?"},
    ])
    transcript = renderer.render(messages)
    for count in range(1, len(messages)):
        prefix = renderer.render(messages[:count], generation_prompt=False)
        assert len(prefix.ids) in transcript.cuts
    line_cuts = [c for c in transcript.cuts if TOKENIZER.decode([transcript.ids[c - 1]]).endswith("\n")]
    assert line_cuts
    bounds = [0, *transcript.cuts]
    assert all(b - a >= MIN_SEGMENT_TOKENS or b in line_cuts for a, b in zip(bounds, bounds[1:]))


def test_malformed_conversations_are_input_errors() -> None:
    with pytest.raises(InputError, match="message 0"):
        messages_of([{"role": "wizard", "content": "hi"}])
    with pytest.raises(InputError, match="message 1"):
        messages_of([{"role": "user", "content": "hi"}, {"content": "no role"}])
    with pytest.raises(EmptyTextError):
        messages_of([{"role": "user", "content": "  "}])


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_a_rag_prompt_grafts_from_the_second_ask_and_equals_the_text_path(family: str) -> None:
    engine = KVEngine(tiny(family), "memory://")
    messages = rag_messages("Who built the lighthouse?", [DOC_A, DOC_B, DOC_C])
    first = engine.chat(messages, deposit_missing=True, max_new_tokens=6)
    second = engine.chat(messages, max_new_tokens=6)
    text = engine.chat(messages, graft=False, max_new_tokens=6)
    assert first.receipt.mode == "text-prefill" and text.receipt.mode == "text-prefill"
    assert second.receipt.mode == "exact-graft" and second.receipt.tokens_reused > 0
    assert {g.receipt.first_token_logits_sha256 for g in (first, second, text)} == {text.receipt.first_token_logits_sha256}
    assert first.tokens == second.tokens == text.tokens
    # Another question over the same documents grafts everything before the question.
    other_messages = rag_messages("When was the lamp electrified?", [DOC_A, DOC_B, DOC_C])
    other = engine.chat(other_messages, max_new_tokens=4)
    assert other.receipt.mode == "partial-graft"  # the documents grafted; the new question read after them
    assert other.receipt.tokens_reused >= second.receipt.tokens_reused - MIN_SEGMENT_TOKENS - 12
    assert other.tokens == engine.chat(other_messages, graft=False, max_new_tokens=4).tokens


def test_turn_three_grafts_turns_one_and_two() -> None:
    engine = KVEngine(tiny("qwen2"), "memory://")
    conversation = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": DOC_A + "\nRemember this."}]
    receipts = []
    for follow_up in ["Who built it?", "How tall is it?"]:
        answer = engine.chat(conversation, deposit_missing=True, max_new_tokens=5)
        receipts.append(answer.receipt)
        conversation += [{"role": "assistant", "content": answer.text}, {"role": "user", "content": follow_up}]
    third = engine.chat(conversation, max_new_tokens=5)
    new_message = Renderer(engine.model.tokenizer).render(messages_of(conversation))
    before_last = Renderer(engine.model.tokenizer).render(messages_of(conversation[:-1]), generation_prompt=False)
    assert third.receipt.mode == "exact-graft"
    assert third.receipt.tokens_reused == len(before_last.ids)  # turns 1-2, all of them
    assert third.receipt.tokens_prefilled == len(new_message.ids) - len(before_last.ids)  # only the new message
    assert third.tokens == engine.chat(conversation, graft=False, max_new_tokens=5).tokens


def test_a_conversation_deposited_ahead_grafts_on_its_first_ask() -> None:
    engine = KVEngine(tiny("llama"), "memory://")
    history = [{"role": "system", "content": "Answer from the documents."}, {"role": "user", "content": DOC_A},
               {"role": "assistant", "content": "Read."}]
    refs = engine.deposit_chat(history)
    answer = engine.chat([*history, {"role": "user", "content": "Who built it?"}], max_new_tokens=4)
    assert answer.receipt.mode == "exact-graft" and answer.receipt.tokens_reused == refs[-1].end
