"""A forged frame table beside a genuine signed manifest allocates nothing it claims."""

from __future__ import annotations

import json
import resource

import pytest

from ..conftest import DOC_A, QUESTION
from .conftest import engine, text_logits


def _raw(server):
    import redis

    return redis.Redis(port=server.port)


@pytest.mark.parametrize("claimed", [2 << 30, 15 << 30])
def test_a_record_claiming_a_huge_payload_is_refused_before_allocating(server, claimed):
    victim = engine(server.url)
    ref = victim.deposit(DOC_A)
    name = f"kvrag:{{{ref.key}}}:m"
    record = json.loads(_raw(server).get(name))
    frames = -(-claimed // record["frame_bytes"])
    record.update(payload_bytes=claimed, frames=[record["frames"][0]] * frames)  # the genuine manifest stays
    _raw(server).set(name, json.dumps(record))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    answer = victim.generate(QUESTION, states=[ref], max_new_tokens=1)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert answer.receipt.mode == "text-prefill" and answer.receipt.states[0].reason == "integrity"
    assert "frame table" in answer.receipt.states[0].detail
    assert answer.receipt.first_token_logits_sha256 == text_logits()
    assert grown_kib < 200 * 1024  # nothing near the claimed size was ever allocated


def test_a_record_whose_frame_size_disagrees_with_the_manifest_is_refused(server):
    victim = engine(server.url)
    ref = victim.deposit(DOC_A)
    name = f"kvrag:{{{ref.key}}}:m"
    record = json.loads(_raw(server).get(name))
    # Two frames of half the payload each: a small record, read well within the deadline on a
    # loaded machine, whose frame size is not the one the signed manifest's chunking names.
    half = -(-record["payload_bytes"] // 2)
    assert half != record["frame_bytes"]
    record.update(frame_bytes=half, frames=[record["frames"][0]] * 2)
    _raw(server).set(name, json.dumps(record))
    answer = victim.generate(QUESTION, states=[ref], max_new_tokens=1)
    assert answer.receipt.states[0].reason == "integrity", answer.receipt.states[0].detail
    assert answer.receipt.first_token_logits_sha256 == text_logits()


@pytest.mark.parametrize("attn", ["sdpa", "invariant"])  # invariant: its answers ask whether states are whole
def test_a_record_listing_more_frames_than_any_state_has_is_refused_before_one_is_asked_for(server, attn):
    from kvrag import KVEngine
    from kvrag.stores.redis.frames import MAX_FRAMES

    from ..conftest import tiny
    from .conftest import DEADLINE_S

    victim = KVEngine(tiny("llama", "float32", attn), server.url, deadline_s=DEADLINE_S)
    ref = victim.deposit(DOC_A)
    name = f"kvrag:{{{ref.key}}}:m"
    record = json.loads(_raw(server).get(name))
    count = MAX_FRAMES + 1  # consistent in itself: that many one-byte frames
    record.update(payload_bytes=count, frame_bytes=1, frames=["0" * 64] * count)
    _raw(server).set(name, json.dumps(record))
    before = _raw(server).info("commandstats").get("cmdstat_exists", {}).get("calls", 0)
    assert not victim.holds(ref)  # the completeness check refuses it
    assert _raw(server).info("commandstats").get("cmdstat_exists", {}).get("calls", 0) == before
    answer = victim.generate(QUESTION, states=[ref], max_new_tokens=1)
    assert answer.receipt.mode == "text-prefill" and answer.receipt.states[0].reason == "integrity"
