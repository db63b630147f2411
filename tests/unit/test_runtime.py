"""One runtime owns the model: every forward over it runs in its turn, whoever asks (answers on
several threads, tenants' engines, a second engine over the same model, background deposits and
their canaries, `verify`'s stock passes), so no two forwards ever overlap; and every answer given
among them equals, logits bit for bit and token for token, the same request asked alone after."""

from __future__ import annotations

import threading

import pytest

from kvrag import KVEngine, MemoryStore, Runtime, load_model
from kvrag.apps.verify import _one_stock_pass
from kvrag.core import RAG_DEFAULTS
from kvrag.core.batching import Batcher
from kvrag.models.turns import Turns

from ..conftest import DOC_A, DOC_B, DOC_C, QUESTION

DOCS = [DOC_A, DOC_B, DOC_C]


class Overlaps:
    """Counts the forwards running over a model at once (hooks on its top module)."""

    def __init__(self, hf_model) -> None:
        self.active = self.most = self.calls = 0
        self._lock = threading.Lock()
        hf_model.register_forward_pre_hook(self._enter)
        hf_model.register_forward_hook(self._leave)

    def _enter(self, *_) -> None:
        with self._lock:
            self.active += 1
            self.calls += 1
            self.most = max(self.most, self.active)

    def _leave(self, *_) -> None:
        with self._lock:
            self.active -= 1


@pytest.fixture
def model():
    return load_model("tiny-random-llama")  # a model of this test's own: its hooks reach no other test


def _requests():
    options = RAG_DEFAULTS.replace(max_new_tokens=6, memo=False)
    return [(f"{QUESTION} ({i})", [DOCS[i % 3], DOCS[(i + 1) % 3]][: 1 + i % 2], options) for i in range(6)]


def test_no_two_forwards_overlap_and_every_answer_equals_it_alone(model):
    overlaps = Overlaps(model.hf_model)
    runtime = Runtime(model)
    engines = {"server": KVEngine(runtime, MemoryStore())}
    engines["tenant"] = engines["server"].tenant("acme")
    engines["another"] = KVEngine(model, MemoryStore())  # its own runtime, the same model
    answers: dict[tuple[str, int], tuple[str, list[int]]] = {}
    failures: list[BaseException] = []
    start = threading.Barrier(len(engines) + 1)

    def ask(name: str) -> None:
        try:
            start.wait()
            for index, (question, docs, options) in enumerate(_requests()):
                generation = engines[name].generate(question, states=docs, options=options)
                answers[name, index] = (generation.receipt.first_token_logits_sha256, generation.tokens)
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(e)

    def stock() -> None:
        start.wait()
        ids = engines["server"].plan([DOC_A])[0].ids
        for _ in range(6):
            _one_stock_pass(model, ids)

    threads = [threading.Thread(target=ask, args=(name,)) for name in engines] + [threading.Thread(target=stock)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert all(engine.deposits.wait(120) for engine in engines.values())
    assert not failures, failures
    assert overlaps.calls > 3 * len(_requests()) and overlaps.most == 1, (overlaps.calls, overlaps.most)
    assert runtime.deposits.stats.deposited >= 2 and runtime.deposits.stats.failed == 0

    # asked alone afterwards, on an engine of its own over an empty store: the same bits, the same tokens
    alone = KVEngine(model, MemoryStore())
    for (name, index), (sha, tokens) in answers.items():
        question, docs, options = _requests()[index]
        solo = alone.generate(question, states=docs, options=options.replace(deposit_missing=False))
        assert (solo.receipt.first_token_logits_sha256, solo.tokens) == (sha, tokens), (name, index)


def test_tenants_share_the_runtime_and_keep_every_setting(model):
    runtime = Runtime(model, ready_buffers_bytes=1 << 20)
    server = KVEngine(runtime, MemoryStore(), signing_key=b"operator key", deadline_s=2.5, stream_grafts=True,
                      system_prompt="Answer briefly.", allow_unsigned=True)
    tenant = server.tenant("acme")
    assert tenant.runtime is runtime and tenant.runner is server.runner
    assert tenant.deposits is server.deposits and tenant.continuer.ready is server.continuer.ready is runtime.ready
    assert (tenant.deadline_s, tenant.continuer.stream_grafts, tenant.allow_unsigned) == (2.5, True, True)
    assert tenant.layout == server.layout != KVEngine(runtime, MemoryStore()).layout  # the operator's system prompt
    assert tenant.namespace == "acme" and tenant.signing_key != server.signing_key  # the tenant's own key
    assert tenant.identity.scope != server.identity.scope
    # the batch is set once, on the runtime: engines made before it and after it use it alike
    runtime.batcher = batcher = Batcher(runtime.runner, rows=4)
    later = server.tenant("later")
    for engine in (server, tenant, later):
        assert engine.continuer.batching.batcher is engine.depositor.batching.batcher is batcher
    runtime.batcher = None
    assert tenant.continuer.batching.batcher is later.depositor.batching.batcher is None
    batcher.close()


def test_turns_are_fair_and_reentrant():
    turns, order = Turns(), []
    first_in = threading.Event()

    def holder() -> None:
        with turns.turn():
            first_in.set()
            with turns.turn():  # the holder's own forward inside its turn
                order.append("holder")
            waiting.wait()
            threading.Event().wait(0.05)

    def later(name: str, ready: threading.Event) -> None:
        ready.set()
        with turns.turn():
            order.append(name)

    waiting = threading.Event()
    threads = [threading.Thread(target=holder)]
    threads[0].start()
    assert first_in.wait(10)
    for name in ("b", "c", "d"):  # each asks after the one before: served in that order
        ready = threading.Event()
        thread = threading.Thread(target=later, args=(name, ready))
        thread.start()
        ready.wait(10)
        while turns._next <= len(threads):  # it holds a ticket before the next one asks
            threading.Event().wait(0.001)
        threads.append(thread)
    waiting.set()
    for thread in threads:
        thread.join(10)
    assert order == ["holder", "b", "c", "d"] and turns.waited == 3 and not turns.held


def test_a_deposit_read_for_an_answer_is_stored_only_if_it_reproduces_that_answer(model):
    """The canary compares a state with the computation that made it; the answer check compares it
    with another one, the answer's. A computation that went wrong (here: the weights changed between
    the answer and its deposit, as interference would change what a forward reads) passes the
    canary, and is refused by the answer check, with nothing stored."""
    import torch

    from kvrag.core.deposit import Answered
    from kvrag.errors import VerificationError

    engine = KVEngine(model, MemoryStore())
    checked = engine.depositor.answers_checked
    engine.generate(QUESTION, states=[DOC_A, DOC_B], max_new_tokens=2, deposit_missing=True)
    assert engine.depositor.answers_checked == checked + 1 and engine.depositor.answers_refused == 0
    assert engine.generate(QUESTION, states=[DOC_A, DOC_B], max_new_tokens=2).receipt.mode == "exact-graft"

    segments = engine.plan([DOC_C, DOC_A])
    answer = engine.generate(QUESTION, states=[DOC_C, DOC_A], max_new_tokens=2)
    answered = Answered(tuple(engine.planner.question(QUESTION, segments)), answer.receipt.first_token_logits_sha256)
    weight = model.hf_model.get_input_embeddings().weight
    with torch.no_grad():
        weight.mul_(1.001)
    try:
        with pytest.raises(VerificationError, match="did not reproduce the answer"):
            engine.depositor.extend(segments, answered)
        assert not any(engine.store.holds(s.key) for s in segments) and engine.depositor.answers_refused == 1
        assert engine.depositor.extend(segments)  # the canary alone passes the same computation
    finally:
        with torch.no_grad():
            weight.div_(1.001)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_answers_never_write_into_the_stored_bytes_they_graft(family):
    # the memory tier's tensors view its stored bytes (no copy): grafts, kept buffers, a sliding
    # window's layers and the batch must only ever read them
    import hashlib

    store = MemoryStore()
    engine = KVEngine(load_model(f"tiny-random-{family}"), store)
    engine.deposit_chain([DOC_A, DOC_B])
    engine.deposit(DOC_C)

    def held() -> dict[str, str]:
        return {key: hashlib.sha256(memoryview(store.read(key).payload)).hexdigest() for key in store.keys()}

    before = held()
    assert len(before) == 3
    for states in ([DOC_A, DOC_B], [DOC_A, DOC_B], [DOC_C], [DOC_A, DOC_C]):  # again: from kept buffers
        engine.generate(QUESTION, states=states, max_new_tokens=6, memo=False)
    engine.runtime.batcher = Batcher(engine.runner, rows=4)
    asked = [threading.Thread(target=engine.generate, args=(QUESTION,),
                              kwargs={"states": states, "max_new_tokens": 6, "memo": False})
             for states in ([DOC_A, DOC_B], [DOC_C], [DOC_A, DOC_B])]
    for thread in asked:
        thread.start()
    for thread in asked:
        thread.join(120)
    engine.close()
    assert held() == before
