"""The names stored bytes carry are pinned: moving a module must never rename a stored format, or
every entry written before would stop parsing."""

from __future__ import annotations

from kvrag.artifacts.format import FORMAT
from kvrag.reuse.gate import GateResult
from kvrag.reuse.memo import MemoEntry
from kvrag.stores.redis.frames import FrameTable
from kvrag.trust import signing


def test_every_stored_format_keeps_its_name():
    assert FORMAT == "kvrag.state/1"
    assert MemoEntry.model_fields["format"].default == "kvrag.memo/1"
    assert GateResult.model_fields["format"].default == "kvrag.gate/1"
    assert FrameTable.model_fields["format"].default == "kvrag.frames/1"
    assert signing.seal(b"k", "memo/" + "0" * 64, b"body").startswith(b"kvrag.sealed/1 ")
