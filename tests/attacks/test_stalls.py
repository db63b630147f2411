"""A stalled or wrong Redis costs at most the deadline; then the text answers, and says so."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import redis

from kvrag import KVEngine, StoreError

from ..conftest import DOC_A, DOC_B, DOC_C, QUESTION, tiny
from .conftest import DEADLINE_S, MODEL_MARGIN_S, engine, timed


def test_a_paused_redis_costs_at_most_the_deadline_then_its_breaker_skips_it(server, tmp_path):
    victim = engine(f"{server.url},disk://{tmp_path}")
    refs = victim.deposit_chain([DOC_A, DOC_B, DOC_C])
    victim.generate(QUESTION, states=refs, max_new_tokens=1)  # warm: connections open
    redis.Redis(port=server.port).execute_command("CLIENT", "PAUSE", 8_000, "ALL")
    try:
        answer, took = timed(lambda: victim.generate(QUESTION, states=refs, max_new_tokens=1, memo=False))
        assert took < DEADLINE_S + MODEL_MARGIN_S, took
        assert answer.receipt.timings.restore_ms < (DEADLINE_S + 0.5) * 1e3
        # the first read waits out the question's deadline, which then covers the disk tier too:
        # every state is read as text, and each says why
        assert answer.receipt.mode == "text-prefill"
        assert [u.reason for u in answer.receipt.states] == ["unavailable"] * len(refs)
        assert all("deadline" in (u.detail or "") for u in answer.receipt.states)
        assert answer.receipt.first_token_logits_sha256 == text_logits_for(refs)
        # The breaker is open now: the next question skips Redis and grafts from disk at once.
        again, took = timed(lambda: victim.generate(QUESTION, states=refs, max_new_tokens=1, memo=False))
        assert took < MODEL_MARGIN_S and again.receipt.mode == "exact-graft"
        assert all(u.tier.startswith("disk://") and "skipped" in (u.detail or "") for u in again.receipt.states)
    finally:
        redis.Redis(port=server.port).execute_command("CLIENT", "UNPAUSE")


def text_logits_for(refs):
    return engine("memory://").generate(QUESTION, states=[r.text for r in refs], max_new_tokens=1, graft=False,
                                        memo=False).receipt.first_token_logits_sha256


def test_rediss_pointed_at_a_plain_tcp_server_is_refused_at_once(server):
    """A plaintext server sits through a TLS handshake until the client gives up: that wait is
    bounded, and what it means (a configuration error, not an outage) is said at construction."""
    engine(server.url).deposit(DOC_A)
    began = time.monotonic()
    with pytest.raises(StoreError, match="does not complete a TLS handshake.*redis:// without ssl"):
        engine(server.url.replace("redis://", "rediss://"))
    assert time.monotonic() - began < DEADLINE_S + MODEL_MARGIN_S


def test_a_server_that_accepts_and_never_answers_is_bounded():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held = []
    threading.Thread(target=lambda: [held.append(listener.accept()) for _ in range(16)], daemon=True).start()
    try:
        victim = engine(f"redis://127.0.0.1:{listener.getsockname()[1]}/0")
        answer, took = timed(lambda: victim.generate(QUESTION, states=[DOC_A, DOC_B], max_new_tokens=1))
        assert took < DEADLINE_S + MODEL_MARGIN_S, took
        assert {u.reason for u in answer.receipt.states} == {"unavailable"}
    finally:
        listener.close()


@pytest.mark.parametrize("attn", ["sdpa", "invariant"])
def test_a_paused_redis_costs_chat_and_generate_at_most_their_deadline(server, attn):
    """Every read a question makes (completeness checks, chain and prefix records, memo, states)
    shares one deadline: a paused Redis costs it once, then the text answers."""
    deadline_s = 2.0
    writer = KVEngine(tiny("llama", "float32", attn), server.url, deadline_s=deadline_s)
    refs = writer.deposit_chain([DOC_A, DOC_B])
    messages = [{"role": "system", "content": "Answer from the documents."},
                {"role": "user", "content": f"{DOC_A}\n{DOC_B}\nQuestion: {QUESTION}"}]
    writer.deposit_chat(messages)
    for ask in (lambda e: e.generate(QUESTION, states=refs, max_new_tokens=1),
                lambda e: e.chat(messages, max_new_tokens=1)):
        victim = KVEngine(tiny("llama", "float32", attn), server.url, deadline_s=deadline_s)  # a fresh breaker
        redis.Redis(port=server.port).execute_command("CLIENT", "PAUSE", 8_000, "ALL")
        try:
            answer, took = timed(lambda: ask(victim))
        finally:
            redis.Redis(port=server.port).execute_command("CLIENT", "UNPAUSE")
        assert took < deadline_s + MODEL_MARGIN_S, took
        assert answer.receipt.tokens_reused == 0 and {u.source for u in answer.receipt.states} == {"text"}
