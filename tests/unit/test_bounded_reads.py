"""Bounded store reads: abandoned reads of a stalled tier never make a healthy tier's reads wait."""

from __future__ import annotations

import threading
import time

import pytest

from kvrag.errors import StoreUnavailableError
from kvrag.stores.deadline import Deadline, bounded


def test_reads_abandoned_past_their_deadline_do_not_hold_up_the_next_ones():
    stalled = threading.Event()
    try:
        for _ in range(40):  # more abandoned reads than the pool has threads
            with pytest.raises(StoreUnavailableError):
                bounded(lambda: stalled.wait(30), Deadline(0.01), "a stalled read")
        began = time.monotonic()
        assert bounded(lambda: "served", Deadline(2.0), "a healthy read") == "served"
        assert time.monotonic() - began < 1.5
    finally:
        stalled.set()
