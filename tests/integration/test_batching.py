"""Generations whose decoding steps share forwards (`kvrag.core.batching`) answer exactly as each
alone: tokens, first-token logits and every step's logits, whatever else is in the batch and
whenever it joined or left."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvrag import KVEngine, MemoryStore
from kvrag.core import batching
from kvrag.core.batching import Batcher
from kvrag.core.deposit import DEPOSIT_READ_ROWS
from kvrag.core.prefill import Prefill
from kvrag.core.runner import DecodeStep, ModelRunner, PromptRead, logits_sha256

from ..conftest import DOC_A, DOC_B, DOC_C, DTYPES, FAMILIES, QUESTION, tiny

#: what the requests ask: grafted, partly grafted, read as text, sampled with a seed, one abandoned
REQUESTS = [
    dict(query=QUESTION, states=[DOC_A], max_new_tokens=24),
    dict(query="When was the lamp electrified?", states=[DOC_B, DOC_C], max_new_tokens=30),
    dict(query="How many steps lead to the lantern room, and what is kept there today?", states=[DOC_C, DOC_A],
         max_new_tokens=20, graft=False),
    dict(query=QUESTION, states=[DOC_B], max_new_tokens=26, temperature=0.9, seed=7),
    dict(query="Say something.", states=[DOC_A, DOC_B], max_new_tokens=40),
]
ABANDONED = 4  # its client goes away after a few deltas
STARTS = [0, 0, 3, 5, 1]  # the batch forwards run before each request arrives


def _alone(runner: ModelRunner, prompt: list[int], steps: int) -> list[str]:
    run = Prefill(runner)
    logits = run.text(prompt)
    shas = [logits_sha256(logits)]
    for _ in range(steps):
        logits = runner.step(int(logits.argmax()), run.cache)
        shas.append(logits_sha256(logits))
    return shas


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_step_of_a_packed_forward_equals_the_step_alone(family, dtype):
    runner = ModelRunner(tiny(family, dtype))
    generator = torch.Generator().manual_seed(0)
    # lengths across key blocks and past the sliding window; a short one stays under the padding
    prompts = [torch.randint(3, 250, (n,), generator=generator).tolist() for n in (5, 40, 130, 700)]
    expected = [_alone(runner, prompt, 8) for prompt in prompts]
    live: list[tuple[int, Prefill, int, list[str]]] = []
    for index, prompt in enumerate(prompts):  # each joins a batch already under way
        run = Prefill(runner)
        logits = run.text(prompt)
        live.append((index, run, int(logits.argmax()), [logits_sha256(logits)]))
    for _ in range(8):
        outs = runner.step_many([DecodeStep(token, len(prompts[i]) + len(shas) - 1, run.cache)
                                 for i, run, token, shas in live])
        live = [(i, run, int(out.argmax()), shas + [logits_sha256(out)]) for (i, run, _, shas), out in zip(live, outs)]
    assert [shas for _, _, _, shas in sorted(live, key=lambda r: r[0])] == expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_reads_packed_beside_steps_equal_each_read_alone(family, dtype):
    runner = ModelRunner(tiny(family, dtype))
    generator = torch.Generator().manual_seed(1)
    # contexts across key blocks; questions under the padding, of one row and longer; two first reads
    contexts = [torch.randint(3, 250, (n,), generator=generator).tolist() for n in (5, 40, 130, 700)]
    questions = [torch.randint(3, 250, (n,), generator=generator).tolist() for n in (3, 20, 1, 17)]

    def alone(context: list[int], question: list[int]) -> tuple[str, str]:
        run = Prefill(runner)
        run.text(context)
        logits = run.text(question)
        return logits_sha256(logits), logits_sha256(runner.step(int(logits.argmax()), run.cache))

    expected = [alone(c, q) for c, q in zip(contexts, questions)]
    runs = [Prefill(runner) for _ in contexts]
    firsts = [int(run.text(c).argmax()) for run, c in zip(runs, contexts)]
    fresh = [Prefill(runner) for _ in range(2)]
    items = [DecodeStep(firsts[0], len(contexts[0]), runs[0].cache),
             *(PromptRead(q, run.cache) for run, q in zip(runs[1:], questions[1:])),
             *(PromptRead(c, run.cache) for run, c in zip(fresh, contexts[:2]))]
    calls: list[int] = []
    hook = runner.model.hf_model.register_forward_pre_hook(lambda *_: calls.append(1))
    outs = runner.step_many(items)
    hook.remove()
    # a model without sliding layers reads in the shared forward; one with them, each read alone
    assert len(calls) == (1 if all(codec.window is None for codec in runner.codecs) else 1 + len(items) - 1)
    got = [(logits_sha256(out), logits_sha256(runner.step(int(out.argmax()), run.cache)))
           for run, out in zip(runs[1:], outs[1:4])]
    assert got == expected[1:]
    for run, context, out in zip(fresh, contexts, outs[4:]):
        assert run.cache.get_seq_length() == len(context)
        assert logits_sha256(out) == logits_sha256(runner.forward(context, runner.new_cache()))


def _run(engine: KVEngine, request: dict, batcher: Batcher, start: int, out: dict, index: int) -> None:
    deadline = time.monotonic() + 60
    while batcher.forwards < start and time.monotonic() < deadline:  # arrive while others decode
        time.sleep(0.001)
    stream = engine.stream(**request, memo=False)
    if index == ABANDONED:
        deltas = iter(stream)
        out[index] = [next(deltas, "") for _ in range(3)]
        deltas.close()  # the client went away: its row is freed at the next step
        return
    out[index] = stream.result()


def _concurrently(engine: KVEngine, requests: list[dict], starts: list[int], rows: int) -> tuple[Batcher, dict]:
    """`requests` on threads of their own through a batcher of `rows`, each arriving after its
    `starts` batch forwards; the batcher (closed) and each request's result by index."""
    batcher = Batcher(engine.runner, rows=rows)
    engine.runtime.batcher = batcher
    out: dict[int, object] = {}
    threads = [threading.Thread(target=_run, args=(engine, r, batcher, s, out, i))
               for i, (r, s) in enumerate(zip(requests, starts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    batcher.close()
    return batcher, out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_concurrent_answers_equal_each_answer_alone(family, dtype, monkeypatch):
    # every batch waits for all the generations under way: they do share forwards, at every step
    monkeypatch.setattr(batching, "GATHER_S", 10.0)
    engine = KVEngine(tiny(family, dtype), MemoryStore())
    for document in (DOC_A, DOC_B):
        engine.deposit(document)
    alone = [engine.generate(**request, memo=False) for request in REQUESTS]
    batcher, out = _concurrently(engine, REQUESTS, STARTS, rows=8)
    for index, expected in enumerate(alone):
        if index == ABANDONED:
            assert expected.text.startswith("".join(out[index]).strip())
            continue
        got = out[index]
        assert got.tokens == expected.tokens, index
        assert got.receipt.first_token_logits_sha256 == expected.receipt.first_token_logits_sha256
        assert got.receipt.mode == expected.receipt.mode
    assert batcher.members == 0
    if batcher.exact:
        assert batcher.stepped_rows > batcher.forwards  # forwards carried several generations' steps
    else:  # each step its own forward
        assert batcher.stepped_rows == batcher.forwards


def test_smollm2_answers_in_a_batch_equal_each_alone(smollm2, monkeypatch):
    monkeypatch.setattr(batching, "GATHER_S", 10.0)
    engine = KVEngine(smollm2, MemoryStore())
    engine.deposit(DOC_A)
    requests = [dict(query=QUESTION, states=[DOC_A], max_new_tokens=10),
                dict(query="When was the lamp electrified?", states=[DOC_B], max_new_tokens=12),
                dict(query="What is in the lantern room?", states=[DOC_C, DOC_A], max_new_tokens=8, graft=False)]
    alone = [engine.generate(**request, memo=False) for request in requests]
    batcher, out = _concurrently(engine, requests, [0, 0, 2], rows=4)
    for index, expected in enumerate(alone):
        assert out[index].tokens == expected.tokens
        assert out[index].receipt.first_token_logits_sha256 == expected.receipt.first_token_logits_sha256
    assert batcher.stepped_rows > batcher.forwards


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2", "smollm2-135m"])
def test_a_deposit_beside_answers_reads_in_the_batch_and_stores_the_bytes_made_alone(family, monkeypatch, request):
    # a deposit's reads (its prefill, the canaries) go through the batch (in its idle forwards)
    # instead of taking the model between them; what it stores is what a deposit alone stores,
    # and the answers beside it are the answers alone
    monkeypatch.setattr(batching, "GATHER_S", 10.0)
    model = request.getfixturevalue("smollm2") if family == "smollm2-135m" else tiny(family)
    alone_engine = KVEngine(model, MemoryStore())
    alone_refs = alone_engine.deposit_chain([DOC_B, DOC_C])
    stored_alone = [alone_engine.store.read_manifest(r.key) for r in alone_refs]
    engine = KVEngine(model, MemoryStore())
    engine.deposit(DOC_A)
    requests = [dict(query=QUESTION, states=[DOC_A], max_new_tokens=40),
                dict(query="Who keeps it?", states=[DOC_A], max_new_tokens=40)]
    alone = [engine.generate(**request, memo=False) for request in requests]
    reads: list[int] = []
    read = batching.Lane.read

    def counted(lane: batching.Lane, ids, cache):
        if threading.current_thread() is threading.main_thread():
            reads.append(len(ids))
        return read(lane, ids, cache)

    monkeypatch.setattr(batching.Lane, "read", counted)
    batcher = Batcher(engine.runner, rows=4)
    engine.runtime.batcher = batcher
    out: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i, r=r: out.__setitem__(i, engine.generate(**r, memo=False)))
               for i, r in enumerate(requests)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while batcher.forwards < 3 and time.monotonic() < deadline:  # deposit while they decode
        time.sleep(0.001)
    refs = engine.deposit_chain([DOC_B, DOC_C])
    for thread in threads:
        thread.join(300)
    batcher.close()
    assert len(reads) >= 2 * 3  # each state: its prefill and two canaries, in the batch
    if engine.runner.packs_reads:  # a long read in pieces, so no forward carries much of it
        assert max(reads) <= DEPOSIT_READ_ROWS
        if family != "smollm2-135m":  # byte tokens: these documents are longer than one piece
            assert max(len(engine.tokenize(d)) for d in (DOC_B, DOC_C)) > DEPOSIT_READ_ROWS
    assert [engine.store.read_manifest(r.key) for r in refs] != [None, None]
    for got, want in zip([engine.store.read_manifest(r.key) for r in refs], stored_alone):
        assert _payload_sha(got) == _payload_sha(want)
    for index, expected in enumerate(alone):
        assert out[index].tokens == expected.tokens
        assert out[index].receipt.first_token_logits_sha256 == expected.receipt.first_token_logits_sha256


def _payload_sha(manifest: bytes) -> str:
    import json

    return json.loads(manifest)["payload_sha256"]


@pytest.mark.parametrize("patience", [60.0, 0.2])
def test_a_background_read_waits_for_the_answers_under_way_at_most_its_patience(patience, monkeypatch):
    # a deposit's read runs in a forward no answer waits on; past its patience, beside them
    monkeypatch.setattr(batching, "BACKGROUND_WAIT_S", patience)
    engine = KVEngine(tiny("llama"), MemoryStore())
    batcher = Batcher(engine.runner, rows=4)
    engine.runtime.batcher = batcher
    answering = threading.Thread(target=lambda: engine.generate("Write at length.", states=[DOC_A],
                                                                 max_new_tokens=300, memo=False))
    answering.start()
    deadline = time.monotonic() + 60
    while batcher.members == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    forwards_before = batcher.forwards
    cache = engine.runner.new_cache()
    with batcher.lane(background=True) as lane:
        lane.read(engine.tokenize(DOC_B), cache)
    answer_under_way = answering.is_alive()
    answering.join(300)
    batcher.close()
    assert batcher.forwards > forwards_before
    assert answer_under_way == (patience < 1)  # it waited for the answer to end, or only its patience


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_under_other_kernels_steps_take_turns_each_its_own_forward(attn, monkeypatch):
    # sdpa's and eager's bits depend on the rows a call holds: the batcher does not pack them
    monkeypatch.setattr(batching, "GATHER_S", 10.0)
    engine = KVEngine(tiny("llama", attn=attn), MemoryStore())
    engine.deposit(DOC_A)
    alone = [engine.generate(**request, memo=False) for request in REQUESTS[:3]]
    batcher, out = _concurrently(engine, REQUESTS[:3], [0, 0, 2], rows=4)
    assert not batcher.exact
    for index, expected in enumerate(alone):
        assert out[index].tokens == expected.tokens
        assert out[index].receipt.first_token_logits_sha256 == expected.receipt.first_token_logits_sha256
    assert batcher.stepped_rows == batcher.forwards


def test_a_request_arriving_mid_answer_advances_a_token_per_forward(monkeypatch):
    # its answer does not wait for the other to finish: it joins the batch at its first step
    monkeypatch.setattr(batching, "GATHER_S", 10.0)
    engine = KVEngine(tiny("llama"), MemoryStore())
    batcher = Batcher(engine.runner, rows=4)
    engine.runtime.batcher = batcher
    long = threading.Thread(target=lambda: engine.generate("Write at length.", states=[DOC_A], max_new_tokens=200,
                                                           memo=False))
    long.start()
    deadline = time.monotonic() + 60
    while batcher.forwards < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    joined: list[int] = []  # the forwards run when it asked for its first read (it plans and reads the store before)
    read = batching.Lane.read

    def first_read(lane: batching.Lane, *args: object) -> object:
        if threading.current_thread() is threading.main_thread() and not joined:
            joined.append(batcher.forwards)
        return read(lane, *args)

    monkeypatch.setattr(batching.Lane, "read", first_read)
    short = engine.generate(QUESTION, states=[DOC_B], max_new_tokens=6, memo=False)
    after = batcher.forwards
    long.join(300)
    batcher.close()
    # from its first read on, every forward carries its next read or step (the batch waits for a
    # generation it holds): its reads (each context segment read as text, then its question) and
    # its steps after the first token, plus the one forward under way when it joined
    reads = sum(use.source == "text" for use in short.receipt.states) + 1
    assert after - joined[0] <= reads + short.receipt.decode_tokens - 1 + 1
