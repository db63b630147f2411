"""Calls point down the layers at run time too: on a question's whole path (a first answer read as
text and deposited behind it, a graft from the store, a graft from kept buffers, a batch of
packed reads and steps, a memo entry made and recalled, two documents with one missing, a
streamed graft, a blend gate's calibration) no function of a lower
layer calls a function of a higher one: no lower layer is handed a higher layer's callable or
object and calls it. The import test (`test_architecture.py`) sees what is imported; this one sees
what is called, callbacks and objects handed down included.

Not counted: resuming a generator (iterating an answer's stream is reading data, not a callback)
and the calls `KNOWN` names, each with why it stays."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from types import FrameType
from typing import Any

from kvrag import KVEngine, Provenance
from kvrag.core.batching import Batcher
from kvrag.stores import MemoryStore
from tests.conftest import DOC_A, DOC_B, QUESTION, tiny
from tests.unit.test_architecture import _layer

#: (caller's layer, callee module) pairs allowed to call upward, and why
KNOWN = {
    # A store checks a state as its bytes arrive: the reader's acceptance (core; a streamed read's
    # reports its progress too) is handed to the store's fetch, so that nothing unchecked is
    # allocated or returned. Only the store knows when its bytes arrive.
    ("kvrag.stores", "kvrag.core.acceptance"),
    ("kvrag.stores", "kvrag.core.streaming"),
    # A streamed state's tensors (opt-in `stream_grafts`) are a mapping whose items wait for the
    # checked chunks that hold them; a codec reads it as any mapping of a state's tensors.
    ("kvrag.codecs", "kvrag.core.streaming"),
}
_GENERATOR = 0x20  # inspect.CO_GENERATOR


def _upward_calls(run: Any) -> Counter[tuple[str, str, str, str]]:
    """(caller module, caller function, callee module, callee function) of every upward call `run()` makes."""
    seen: Counter[tuple[str, str, str, str]] = Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        back = frame.f_back
        if event != "call" or back is None or frame.f_code.co_flags & _GENERATOR:
            return
        callee, caller = frame.f_globals.get("__name__", ""), back.f_globals.get("__name__", "")
        if not (callee.startswith("kvrag") and caller.startswith("kvrag")):
            return
        if any(caller.startswith(layer) and callee == known for layer, known in KNOWN):
            return
        if _layer(callee) > _layer(caller):
            seen[(caller, back.f_code.co_name, callee, frame.f_code.co_name)] += 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return seen


def _a_question_s_whole_path() -> None:
    # the engine (and so its deposit worker's thread) is made while calls are watched
    with KVEngine(tiny("llama"), MemoryStore()) as engine:
        _questions(engine)


def _questions(engine: KVEngine) -> None:
    answer = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=4, deposit_missing=True,
                             deposit_in_background=True)  # read as text, deposited on the worker
    assert engine.deposits.wait(30)
    assert KVEngine(engine.runtime, engine.store).generate(QUESTION, states=[DOC_A], max_new_tokens=4).receipt.mode == "exact-graft"
    engine.generate(QUESTION, states=[DOC_A], max_new_tokens=4)  # kept buffers
    engine.generate(QUESTION, states=[DOC_A, DOC_B], max_new_tokens=4)  # one grafted, one read
    engine.memo.memoize(QUESTION, answer, states=[DOC_A], provenance=Provenance(kind="person", by="test"))
    assert engine.generate(QUESTION, states=[DOC_A], max_new_tokens=4).receipt.mode == "memo"
    streamed = KVEngine(engine.runtime, engine.store, stream_grafts=True)  # layers handed over as they are read
    assert streamed.generate(QUESTION, states=[DOC_A], max_new_tokens=4, memo=False).receipt.mode == "exact-graft"
    engine.gate.calibrate([DOC_A, DOC_B], samples=1)  # blends against their exact paths


def _a_batch() -> None:
    engine = KVEngine(tiny("llama"), MemoryStore())
    batcher = Batcher(engine.runner, rows=4)
    engine.runtime.batcher = batcher
    try:
        asked = [threading.Thread(target=engine.generate, args=(f"{QUESTION} ({n})",),
                                  kwargs={"states": [DOC_A], "max_new_tokens": 3, "memo": False}) for n in range(3)]
        for thread in asked:
            thread.start()
        for thread in asked:
            thread.join(60)
    finally:
        engine.close()


def test_no_call_on_a_question_s_path_goes_up_a_layer():
    assert not _upward_calls(_a_question_s_whole_path)


def test_no_call_in_a_batch_goes_up_a_layer():
    assert not _upward_calls(_a_batch)


def test_the_check_sees_a_callable_handed_down():
    from kvrag.core.prefill import Prefill

    engine = KVEngine(tiny("llama"), MemoryStore())
    higher: dict[str, Any] = {"__name__": "kvrag.engine.handed", "runner": engine.runner}
    exec("def forward(ids, cache):\n    return runner.forward(ids, cache)\n", higher)  # an engine-layer function
    run = Prefill(engine.runner, forward=higher["forward"])
    seen = _upward_calls(lambda: run.text([1, 2, 3]))
    assert ("kvrag.core.prefill", "text", "kvrag.engine.handed", "forward") in seen
