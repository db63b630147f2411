"""Attacks by someone who can write to a shared store (and read its keys), against real Redis
servers started by the tests. Every case checks that the answer still comes, by fallback, with
the logits of the text; that nothing crashes; and that nothing waits past the deadline."""

from __future__ import annotations

import time

import pytest

from kvrag import KVEngine
from kvrag.testing import RedisServer

from ..conftest import DOC_A, QUESTION, tiny

DEADLINE_S = 1.0
#: What a tiny-model answer may add to the deadline on this 2-core machine (prefill and decode).
MODEL_MARGIN_S = 2.0


@pytest.fixture
def server(tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    yield redis
    redis.stop()


def engine(url: str, **kwargs) -> KVEngine:
    return KVEngine(tiny("llama"), url, deadline_s=DEADLINE_S, **kwargs)


def text_logits(doc: str = DOC_A, question: str = QUESTION) -> str:
    """The first-token logits of the plain text arm, the reference every fallback must equal."""
    return engine("memory://").generate(question, states=[doc], max_new_tokens=1, graft=False,
                                        memo=False).receipt.first_token_logits_sha256


def timed(fn):
    began = time.monotonic()
    result = fn()
    return result, time.monotonic() - began
