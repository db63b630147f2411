"""Deposits after answers, off the answer's path (`kvrag.reuse.deposit_queue`): the answer ends
while its deposit still waits, the deposit then lands and grafts, and the queue keeps its byte and
time budgets, each drop counted, with no answer affected."""

from __future__ import annotations

import threading

import pytest

from kvrag import KVEngine, MemoryStore
from kvrag.core import RAG_DEFAULTS
from kvrag.reuse.deposit_queue import DepositQueue
from tests.conftest import DOC_A, DOC_B, DOC_C, QUESTION, READ_AS_TEXT, tiny


class Gate:
    """A deposit function that waits until the test opens it, so a test knows where the worker is."""

    def __init__(self, deposit=None) -> None:
        self.open, self.entered, self.calls = threading.Event(), threading.Event(), []
        self.deposit = deposit

    def __call__(self, segments) -> None:
        self.entered.set()
        assert self.open.wait(30), "the test never opened the gate"
        self.calls.append([s.key for s in segments])
        if self.deposit is not None:
            self.deposit(segments)


@pytest.fixture(scope="module")
def engine() -> KVEngine:
    return KVEngine(tiny("llama"), MemoryStore())


def test_an_answer_ends_before_its_deposit_and_the_deposit_then_grafts(engine):
    gate = Gate(engine.depositor.extend)
    queue = engine.continuer.deposits = engine.deposits = DepositQueue(gate, bytes_per_token=engine.model.state_bytes_per_token)
    docs = [DOC_A, DOC_C]
    options = RAG_DEFAULTS.replace(max_new_tokens=3, memo=False)
    first = engine.generate(QUESTION, states=docs, options=options)
    assert first.receipt.mode in READ_AS_TEXT
    # the answer is complete while its deposit is held at the gate: nothing of the chain is stored
    assert gate.entered.wait(30)
    assert not engine.holds(engine.ref(DOC_C, after=engine.ref(DOC_A)))
    # the same question again waits for that deposit (the gate opens while it waits) and grafts it
    threading.Timer(0.2, gate.open.set).start()
    second = engine.generate(QUESTION, states=docs, options=options)
    assert second.receipt.mode == "exact-graft"
    assert any("deposit, under way" in note for note in second.receipt.notes)
    assert queue.wait(60) and queue.stats.deposited == 1 and queue.pending_bytes == 0
    assert second.receipt.first_token_logits_sha256 == engine.generate(
        QUESTION, states=docs, max_new_tokens=3, graft=False).receipt.first_token_logits_sha256


def test_a_deposit_past_the_byte_budget_is_dropped_and_counted(engine):
    segments = engine.plan([DOC_A, DOC_B])
    gate = Gate()
    tokens = sum(len(s.ids) for s in segments)
    queue = DepositQueue(gate, bytes_per_token=1024, max_pending_mib=tokens * 1024 * 1.5 / 2**20)
    assert queue.submit(segments)
    assert not queue.submit(segments), "a chain queued already is not queued twice"
    assert not queue.submit(engine.plan([DOC_C, DOC_A])), "past the byte budget"
    assert queue.stats.dropped_for_bytes == 1
    gate.open.set()
    assert queue.wait(30) and queue.stats.deposited == 1 and queue.pending_bytes == 0
    assert queue.submit(engine.plan([DOC_C, DOC_A])), "the budget is free again"
    assert queue.wait(30) and queue.stats.deposited == 2


def test_a_deposit_that_waited_past_the_time_budget_is_dropped_when_its_turn_comes(engine):
    now = [0.0]
    gate = Gate()
    queue = DepositQueue(gate, bytes_per_token=1, max_wait_s=60, clock=lambda: now[0])
    assert queue.submit(engine.plan([DOC_A]))
    assert gate.entered.wait(30)  # the first is running (it was not late), the second waits behind it
    assert queue.submit(engine.plan([DOC_B]))
    now[0] += 61
    gate.open.set()
    assert queue.wait(30)
    assert queue.stats.deposited == 1 and queue.stats.dropped_for_time == 1
    assert gate.calls == [[engine.plan([DOC_A])[0].key]]


def test_a_failing_deposit_is_counted_and_the_worker_goes_on(engine):
    calls = []

    def deposit(segments):
        calls.append(segments)
        if len(calls) == 1:
            raise RuntimeError("a deposit that breaks")

    queue = DepositQueue(deposit, bytes_per_token=1)
    assert queue.submit(engine.plan([DOC_A])) and queue.wait(30)
    assert queue.submit(engine.plan([DOC_B])) and queue.wait(30)
    assert (queue.stats.failed, queue.stats.deposited, len(calls)) == (1, 1, 2)


def test_without_background_the_deposit_is_made_before_the_answer_returns():
    engine = KVEngine(tiny("llama"), MemoryStore())
    engine.generate(QUESTION, states=[DOC_B], max_new_tokens=2, deposit_missing=True)
    assert engine.holds(engine.ref(DOC_B)) and engine.deposits.stats.queued == 0


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError):
        DepositQueue(lambda s: None, bytes_per_token=0)
    with pytest.raises(ValueError):
        DepositQueue(lambda s: None, bytes_per_token=1, max_wait_s=0)


def test_a_question_waits_for_its_contexts_deposit_at_most_the_queues_wait_budget_then_reads_the_text():
    engine = KVEngine(tiny("llama"), MemoryStore())
    gate = Gate(engine.depositor.extend)
    engine.continuer.deposits = engine.deposits = DepositQueue(gate, bytes_per_token=engine.model.state_bytes_per_token,
                                                               max_wait_s=0.3)
    options = RAG_DEFAULTS.replace(max_new_tokens=2, memo=False)
    engine.generate(QUESTION, states=[DOC_B, DOC_C], options=options)
    assert gate.entered.wait(30)
    held = engine.generate(QUESTION, states=[DOC_B, DOC_C], options=options)  # the gate stays shut
    assert held.receipt.mode in READ_AS_TEXT
    assert any("deposit, under way" in note for note in held.receipt.notes)
    other = engine.generate(QUESTION, states=[DOC_A], options=options.replace(deposit_missing=False))
    assert not any("deposit" in note for note in other.receipt.notes), "another context does not wait"
    gate.open.set()
    assert engine.deposits.wait(60)


def test_a_question_waiting_on_a_queued_deposit_moves_it_ahead_of_the_others(engine):
    gate = Gate()
    queue = DepositQueue(gate, bytes_per_token=1)
    a, b, c = (engine.plan([doc]) for doc in (DOC_A, DOC_B, DOC_C))
    assert queue.submit(a) and gate.entered.wait(30)  # A runs; B, then C, wait behind it
    assert queue.submit(b) and queue.submit(c)
    assert queue.wait_for([c[0].key], 0.01) > 0  # a question about C: C goes next
    gate.open.set()
    assert queue.wait(30)
    assert gate.calls == [[a[0].key], [c[0].key], [b[0].key]]


def test_a_closed_queue_finishes_what_was_queued_and_takes_no_more(engine):
    gate = Gate()
    queue = DepositQueue(gate, bytes_per_token=1)
    assert queue.submit(engine.plan([DOC_A])) and queue.submit(engine.plan([DOC_B]))
    threading.Timer(0.1, gate.open.set).start()
    assert queue.close(30)
    assert queue.stats.deposited == 2 and not queue.submit(engine.plan([DOC_C]))


def test_a_script_that_answers_and_exits_leaves_its_deposit_for_the_next_run(tmp_path):
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from kvrag import KVEngine, DiskStore\n"
        "from kvrag.core import RAG_DEFAULTS\n"
        "from tests.conftest import DOC_A, DOC_B, QUESTION, tiny\n"
        f"engine = KVEngine(tiny('llama'), DiskStore({str(tmp_path)!r}))\n"
        "receipt = engine.generate(QUESTION, states=[DOC_A, DOC_B], options=RAG_DEFAULTS.replace(max_new_tokens=2, memo=False)).receipt\n"
        "print(receipt.mode)\n"
    )
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    assert runs[0].stdout.split()[-1] in READ_AS_TEXT and runs[1].stdout.split()[-1] == "exact-graft"


def test_a_question_does_not_wait_for_a_deposit_of_what_it_grafts_anyway():
    engine = KVEngine(tiny("llama"), MemoryStore())
    engine.deposit(DOC_A)
    gate = Gate(engine.depositor.extend)
    engine.continuer.deposits = engine.deposits = DepositQueue(gate, bytes_per_token=engine.model.state_bytes_per_token)
    options = RAG_DEFAULTS.replace(max_new_tokens=2, memo=False)
    engine.generate(QUESTION, states=[DOC_A, DOC_B], options=options)  # grafts A, queues A -> B
    assert gate.entered.wait(30)
    other = engine.generate(QUESTION, states=[DOC_A, DOC_C], options=options.replace(deposit_missing=False))
    assert other.receipt.states[0].source == "graft"
    assert not any("deposit" in note for note in other.receipt.notes), "A is stored: nothing to wait for"
    gate.open.set()
    assert engine.deposits.wait(60)
