"""Whole-block buffers kept for the next question over the same stored bytes: the same bits as
reading the text, each question's rows its own, never shared by two questions at once, and never
kept past the bytes they were copied from."""

from __future__ import annotations

import gc

from kvrag import KVEngine, MemoryStore
from kvrag.artifacts.digests import CheckedBuffer
from kvrag.codecs import ReadyBuffers

from ..conftest import DOC_A, DOC_B, tiny

QUESTIONS = ["What is in the document?",
             "Give a much longer question about the document, so that its rows reach further into the buffer, please?",
             "Who?", "What is in the document?"]


def test_questions_over_kept_buffers_equal_the_text_arm_bit_for_bit():
    model = tiny("llama")
    kept = KVEngine(model, MemoryStore())
    plain = KVEngine(model, MemoryStore(), ready_buffers_bytes=0)
    refs = kept.deposit_chain([DOC_A, DOC_B])
    for question in QUESTIONS:  # longer, then shorter: rows a longer question wrote are stale, masked
        grafted = kept.generate(question, states=refs, max_new_tokens=3, memo=False)
        text = plain.generate(question, states=[DOC_A, DOC_B], max_new_tokens=3, memo=False, graft=False)
        assert grafted.receipt.mode == "exact-graft"
        assert grafted.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256
        assert grafted.tokens == text.tokens
    assert kept.continuer.ready.reuses >= len(QUESTIONS) - 1
    assert plain.continuer.ready.reuses == 0 and plain.continuer.ready.bytes_held == 0


def test_a_leased_set_is_never_leased_twice_and_serves_again_once_returned():
    pool = ReadyBuffers(1 << 20)
    source = CheckedBuffer(64)
    first = pool.lease([source], [(0, 8)])
    assert first is not None and pool.lease([source], [(0, 8)]) is None  # a second question copies its own
    first.give_back()
    again = pool.lease([source], [(0, 8)])
    assert again is not None and again.entry is first.entry


def test_a_set_is_dropped_with_the_bytes_it_was_copied_from():
    pool = ReadyBuffers(1 << 20)
    source = CheckedBuffer(64)
    lease = pool.lease([source], [(0, 8)])
    import torch

    lease.keep(0, torch.zeros(1, 1, 512, 4), torch.zeros(1, 1, 512, 4))
    lease.give_back()
    assert pool.bytes_held > 0
    del source, lease
    gc.collect()
    assert len(pool) == 0  # the set is gone; its buffers are spares, for any like-shaped graft
    assert pool.bytes_held == 2 * torch.zeros(1, 1, 512, 4).nbytes
    other = pool.lease([CheckedBuffer(64)], [(0, 8)])
    assert other.spare(torch.zeros(1, 1, 9, 5), 512) is None  # another shape
    assert other.spare(torch.zeros(1, 1, 9, 4), 1024) is None  # too few rows
    assert other.spare(torch.zeros(1, 1, 9, 4), 512) is not None
    assert pool.bytes_held == 0 and pool.spares_taken == 1


def test_a_set_whose_source_goes_while_leased_is_spare_only_once_given_back():
    import torch

    pool = ReadyBuffers(1 << 20)
    source = CheckedBuffer(64)
    lease = pool.lease([source], [(0, 8)])
    lease.keep(0, torch.zeros(1, 1, 512, 4), torch.zeros(1, 1, 512, 4))
    del source
    gc.collect()
    other = pool.lease([CheckedBuffer(64)], [(0, 8)])
    assert other.spare(torch.zeros(1, 1, 9, 4), 512) is None  # still the first cache's
    lease.give_back()
    assert other.spare(torch.zeros(1, 1, 9, 4), 512) is not None


def test_grafts_read_from_disk_copy_into_spares_with_the_bits_of_the_text(tmp_path):
    model = tiny("llama")
    engine = KVEngine(model, f"disk://{tmp_path}")
    plain = KVEngine(model, MemoryStore(), ready_buffers_bytes=0)
    refs = engine.deposit_chain([DOC_A, DOC_B])
    for question in QUESTIONS:  # each a fresh read: its buffers gone with it, spare for the next
        grafted = engine.generate(question, states=refs, max_new_tokens=3, memo=False)
        gc.collect()
        text = plain.generate(question, states=[DOC_A, DOC_B], max_new_tokens=3, memo=False, graft=False)
        assert grafted.receipt.mode == "exact-graft"
        assert grafted.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256
        assert grafted.tokens == text.tokens
    assert engine.continuer.ready.spares_taken >= len(QUESTIONS) - 1


def test_nothing_is_kept_past_the_budget():
    import torch

    pool = ReadyBuffers(4096)
    lease = pool.lease([CheckedBuffer(64)], [(0, 8)])
    lease.keep(0, torch.zeros(1, 1, 512, 4), torch.zeros(1, 1, 512, 4))  # 16 KiB: over the budget
    lease.give_back()
    assert pool.bytes_held == 0
    assert ReadyBuffers(0).lease([CheckedBuffer(64)], [(0, 8)]) is None


def test_a_set_made_from_a_read_buffer_goes_when_its_question_is_done(tmp_path):
    engine = KVEngine(tiny("llama"), f"disk://{tmp_path}")  # every read is a new buffer
    ref = engine.deposit(DOC_A)
    for question in QUESTIONS[:2]:
        assert engine.generate(question, states=[ref], max_new_tokens=1, memo=False).receipt.mode == "exact-graft"
        gc.collect()
        assert len(engine.continuer.ready) == 0  # its buffers are spares, never its set
    assert engine.continuer.ready.reuses == 0


def test_a_spare_brings_nothing_of_its_last_question(tmp_path):
    """Whatever a spare held (here: NaN everywhere, which masking alone would not keep out of the
    sums), a graft copied into it answers with the bits of the text."""
    model = tiny("llama")
    engine = KVEngine(model, f"disk://{tmp_path}")
    plain = KVEngine(model, MemoryStore(), ready_buffers_bytes=0)
    refs = engine.deposit_chain([DOC_A, DOC_B])
    pool = engine.continuer.ready
    take = pool._take_spare

    def poisoned(like, rows):
        spare = take(like, rows)
        if spare is not None:
            for buffer in spare:
                buffer.fill_(float("nan"))
        return spare

    pool._take_spare = poisoned
    for question in QUESTIONS:
        grafted = engine.generate(question, states=refs, max_new_tokens=3, memo=False)
        gc.collect()
        text = plain.generate(question, states=[DOC_A, DOC_B], max_new_tokens=3, memo=False, graft=False)
        assert grafted.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256
    assert pool.spares_taken >= len(QUESTIONS) - 1


def test_a_kept_buffer_brings_nothing_of_its_last_question():
    """The rows a question wrote after a kept state (here: made NaN after it) are not the next
    question's: it answers with the bits of the text."""
    import torch
    model = tiny("llama")
    engine = KVEngine(model, MemoryStore())
    plain = KVEngine(model, MemoryStore(), ready_buffers_bytes=0)
    refs = engine.deposit_chain([DOC_A, DOC_B])
    pool = engine.continuer.ready
    for question in QUESTIONS:
        grafted = engine.generate(question, states=refs, max_new_tokens=3, memo=False)
        text = plain.generate(question, states=[DOC_A, DOC_B], max_new_tokens=3, memo=False, graft=False)
        assert grafted.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256
        with torch.inference_mode():  # what the question left after the state: poisoned
            for entry in pool._entries.values():
                for keys, values in entry.layers.values():
                    keys[:, :, refs[-1].end:].fill_(float("nan"))
                    values[:, :, refs[-1].end:].fill_(float("nan"))
    assert pool.reuses >= len(QUESTIONS) - 1
