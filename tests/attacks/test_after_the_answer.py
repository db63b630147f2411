"""Nothing raises after the answer: deposits, promotions and cache writes fail quietly (logged)."""

from __future__ import annotations

import logging

from ..conftest import DOC_A, DOC_B, QUESTION
from .conftest import DEADLINE_S, MODEL_MARGIN_S, engine, text_logits, timed


def test_deposit_missing_with_redis_down_answers_and_logs(server, caplog):
    victim = engine(server.url)
    victim.generate(QUESTION, states=[DOC_A], max_new_tokens=1)  # connected once
    server.stop(kill=True)
    with caplog.at_level(logging.DEBUG, logger="kvrag"):
        answer, took = timed(lambda: victim.generate(QUESTION, states=[DOC_A, DOC_B], max_new_tokens=1,
                                                     deposit_missing=True))
    assert answer.receipt.mode == "text-prefill" and took < DEADLINE_S + MODEL_MARGIN_S
    # the outage is one warning; the deposit it cost is said too, below it (debug)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "is unavailable" in warned[0], warned
    assert "could not deposit" in caplog.text
    assert answer.receipt.first_token_logits_sha256 == engine("memory://").generate(
        QUESTION, states=[DOC_A, DOC_B], max_new_tokens=1, graft=False).receipt.first_token_logits_sha256


def test_the_chat_model_answers_with_redis_down(server):
    from langchain_kvrag import ChatKVRAG  # its default is deposit_missing=True

    chat = ChatKVRAG(engine=engine(server.url), max_tokens=2)
    server.stop(kill=True)
    message = chat.invoke(QUESTION)
    assert message.response_metadata["kvrag_receipt"]["mode"] == "text-prefill"


def test_llamaindex_streaming_answers_with_redis_down(server):
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.llms.kvrag import KVRagLLM, KVSynthesizer

    victim = engine(server.url)
    synthesizer = KVSynthesizer(KVRagLLM(engine=victim, max_new_tokens=2), streaming=True)
    server.stop(kill=True)
    response = synthesizer.synthesize(QUESTION, [NodeWithScore(node=TextNode(text=DOC_A))])
    text = "".join(response.response_gen)
    assert isinstance(text, str) and response.metadata["kvrag_receipt"]["mode"] == "text-prefill"
    assert response.metadata["kvrag_receipt"]["first_token_logits_sha256"] == text_logits()


def test_a_failed_promotion_leaves_the_answer_alone(server, tmp_path):
    victim = engine(f"{server.url},disk://{tmp_path}")
    ref = victim.deposit(DOC_A)
    victim.store.tiers[0].delete(ref.key)  # only the disk tier has it now
    server.stop(kill=True)  # and the hot tier cannot take the promotion
    answer = victim.generate(QUESTION, states=[ref], max_new_tokens=1)
    assert answer.receipt.mode == "exact-graft" and answer.receipt.states[0].tier.startswith("disk://")
