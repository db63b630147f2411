"""A loaded model's tokenizer is safe from any thread: calls with other settings (a user's own
truncating call beside kvrag's) neither change what another thread's call returns nor fail."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest

from kvrag import load_model
from kvrag.models.tiny import build_byte_tokenizer
from kvrag.models.tokenizing import thread_safe

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def _race(tokenizer, rounds: int = 150) -> list[str]:
    """Two threads truncating, two not, at once: what went wrong."""
    whole = len(tokenizer(TEXT)["input_ids"])
    wrong: list[str] = []

    def truncating() -> None:
        for _ in range(rounds):
            try:
                tokenizer(TEXT, truncation=True, max_length=16)
            except Exception as e:  # noqa: BLE001 (any failure is what the test counts)
                wrong.append(repr(e))

    def whole_text() -> None:
        for _ in range(rounds):
            try:
                got = len(tokenizer(TEXT)["input_ids"])
                if got != whole:
                    wrong.append(f"{got} ids, not {whole}")
                tokenizer.decode(list(range(40)))
            except Exception as e:  # noqa: BLE001
                wrong.append(repr(e))

    threads = [threading.Thread(target=f) for f in (truncating, whole_text, truncating, whole_text)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return wrong


@pytest.mark.parametrize("name", ["tiny-random-llama", "smollm2-135m"])
def test_a_truncating_call_beside_another_changes_nothing_it_returns(name):
    assert _race(load_model(name).tokenizer) == []


def test_the_race_is_real_without_the_lock():
    # the same race on a tokenizer kvrag did not make safe: calls return other calls' truncation
    assert _race(build_byte_tokenizer(), rounds=400)


def test_a_safe_tokenizer_copies_and_pickles_with_a_lock_of_its_own():
    tokenizer = thread_safe(build_byte_tokenizer())
    assert thread_safe(tokenizer) is tokenizer
    for other in (copy.deepcopy(tokenizer), pickle.loads(pickle.dumps(tokenizer))):
        assert other("hello")["input_ids"] == tokenizer("hello")["input_ids"]
        assert other._kvrag_guard is not tokenizer._kvrag_guard and _race(other, rounds=50) == []
