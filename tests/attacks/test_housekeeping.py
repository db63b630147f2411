"""Housekeeping beside live writers: gc spares work in progress, prefixes cannot reach each other,
and a state whose payload went missing is noticed and deposited again."""

from __future__ import annotations

import pytest
import redis

from kvrag import StoreError, open_store
from kvrag.apps.maintenance import collect_garbage

from ..conftest import DOC_A, QUESTION
from .conftest import engine


def test_gc_leaves_young_temporary_files_and_orphan_frames_alone(server, tmp_path):
    victim = engine(f"{server.url}?frame_mib=0.01,disk://{tmp_path}")
    ref = victim.deposit(DOC_A)
    # A write in progress: a temporary file, and frames whose record is not written yet.
    temporary = tmp_path / "states" / ref.key[:2] / f".{ref.key}.kvstate.inflight"
    temporary.write_bytes(b"half a state")
    raw = redis.Redis(port=server.port)
    raw.set(f"kvrag:{{{'e' * 64}}}:f:0123456789abcdef:0", b"frame of a write in progress")
    report = collect_garbage(victim.store, grace_s=600)
    assert report.stray_files == 0 and report.orphan_frames == 0 and temporary.exists()
    assert victim.generate(QUESTION, states=[ref], max_new_tokens=1).receipt.mode == "exact-graft"
    report = collect_garbage(victim.store, grace_s=0)  # what an operator asks for explicitly
    assert report.stray_files == 1 and report.orphan_frames == 1 and not temporary.exists()


@pytest.mark.parametrize("prefix", ["kv*", "a?", "[ab]", "x\\y", "", "a b"])
def test_prefixes_with_glob_characters_are_refused(server, prefix):
    with pytest.raises(StoreError, match="prefix"):
        open_store(f"{server.url}?prefix={prefix}" if prefix else f"{server.url}?prefix=")


def test_a_state_whose_payload_went_missing_is_deposited_again(server):
    victim = engine(f"{server.url}?frame_mib=0.01")
    ref = victim.deposit(DOC_A)
    raw = redis.Redis(port=server.port)
    frames = sorted(k.decode() for k in raw.scan_iter(match=f"kvrag:{{{ref.key}}}:f:*"))
    assert len(frames) > 1
    raw.delete(frames[1])
    assert not victim.holds(ref)
    assert victim.ensure(DOC_A) == ref and victim.holds(ref)
    assert victim.generate(QUESTION, states=[ref], max_new_tokens=1).receipt.mode == "exact-graft"
