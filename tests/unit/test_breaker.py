"""The breaker in front of a tier: skipped while open, probed off the caller's path, closed as soon
as a probe passes, and never holding a caller longer than its short wait for a probe."""

from __future__ import annotations

import threading
import time

from kvrag.stores.deadline import Breaker


def test_a_passing_probe_closes_the_breaker_at_the_next_look():
    breaker = Breaker(cooldown_s=30, probe=lambda: True, probe_interval_s=0.05)
    breaker.trip("refused")
    assert breaker.is_open  # the first probe is due only after the interval
    time.sleep(0.06)
    assert not breaker.is_open


def test_a_failing_probe_keeps_it_open_and_says_why():
    def probe() -> bool:
        raise ConnectionRefusedError("nobody there")

    breaker = Breaker(cooldown_s=30, probe=probe, probe_interval_s=0.0)
    breaker.trip("refused")
    assert breaker.is_open
    assert "nobody there" in breaker.probe_failure and "nobody there" in repr(breaker)


def test_a_slow_probe_holds_no_caller_past_its_wait_and_closes_the_breaker_when_it_passes():
    release = threading.Event()

    def probe() -> bool:
        release.wait(5)
        return True

    breaker = Breaker(cooldown_s=30, probe=probe, probe_interval_s=0.0, probe_wait_s=0.05)
    breaker.trip("timed out")
    began = time.monotonic()
    assert breaker.is_open and breaker.is_open  # the second look finds the probe still running
    assert time.monotonic() - began < 2.0
    release.set()
    deadline = time.monotonic() + 5
    while breaker.is_open and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not breaker.is_open


def test_without_a_probe_it_stays_open_for_the_cool_down():
    breaker = Breaker(cooldown_s=0.05)
    breaker.trip("refused")
    assert breaker.is_open
    time.sleep(0.06)
    assert not breaker.is_open


def test_a_probe_that_cannot_start_keeps_it_open_and_the_next_look_probes_again(monkeypatch):
    breaker = Breaker(cooldown_s=30, probe=lambda: True, probe_interval_s=0.0)
    breaker.trip("refused")

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", no_thread)
        assert breaker.is_open  # no crash: the caller skips the tier as before
        assert "could not start" in breaker.probe_failure
    assert not breaker.is_open  # the probe's lock was released: this look probes, and it passes
