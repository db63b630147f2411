"""Sampling: greedy by default; seeded sampling reproducible within and across processes; the
verified first-token logits and the receipt unchanged by it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvrag import InputError, KVEngine, MemoryStore
from kvrag.reuse.memo import Provenance

from ..conftest import DOC_A, QUESTION, tiny

SAMPLED = dict(temperature=0.9, top_p=0.95, top_k=100, seed=1234)


@pytest.fixture
def engine():
    engine = KVEngine(tiny("llama"), MemoryStore())
    engine.deposit(DOC_A)
    return engine


def test_greedy_is_the_default_and_top_k_1_is_greedy(engine):
    greedy = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=8)
    assert greedy.receipt.sampling.greedy and greedy.receipt.sampling.seed is None
    top1 = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=8, temperature=1.5, top_k=1, seed=5)
    assert top1.tokens == greedy.tokens


def test_the_same_seed_gives_the_same_tokens_and_the_logits_are_untouched(engine):
    greedy = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=12)
    first = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=12, **SAMPLED)
    again = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=12, **SAMPLED)
    other = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=12, **{**SAMPLED, "seed": 4321})
    assert first.tokens == again.tokens and first.tokens != other.tokens
    assert first.receipt.mode == "exact-graft"
    assert first.receipt.first_token_logits_sha256 == greedy.receipt.first_token_logits_sha256
    assert first.receipt.sampling.model_dump() == SAMPLED


def test_an_unseeded_sample_records_the_seed_that_replays_it(engine):
    sampled = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=12, temperature=1.0)
    seed = sampled.receipt.sampling.seed
    assert seed is not None
    assert engine.generate(QUESTION, states=[DOC_A], max_new_tokens=12, temperature=1.0, seed=seed).tokens == sampled.tokens


def test_the_same_seed_gives_the_same_tokens_in_another_process(engine):
    here = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=12, **SAMPLED).tokens
    script = (
        "import json, kvrag\n"
        f"e = kvrag.KVEngine(kvrag.load_model('tiny-random-llama'), 'memory://')\n"
        f"print(json.dumps(e.generate({QUESTION!r}, states=[{DOC_A!r}], max_new_tokens=12, **{SAMPLED!r}).tokens))\n"
    )
    there = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(there.stdout.strip().splitlines()[-1]) == here


def test_a_sampled_question_is_never_answered_from_the_memo(engine):
    first = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=8)
    engine.memo.memoize(QUESTION, first, states=[DOC_A], provenance=Provenance(kind="gold", by="test"))
    assert engine.generate(QUESTION, states=[DOC_A], max_new_tokens=8).receipt.mode == "memo"
    assert engine.generate(QUESTION, states=[DOC_A], max_new_tokens=8, **SAMPLED).receipt.mode == "exact-graft"


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1), dict(seed=-3)])
def test_bad_sampling_settings_are_input_errors(engine, bad):
    with pytest.raises(InputError, match="sampling"):
        engine.generate(QUESTION, max_new_tokens=2, **bad)
