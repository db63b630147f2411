"""Reuse at any token boundary: the longest stored prefix of a prompt, wherever it ends.

Under the invariant kernel (`kvrag.kernels.attention`) a position's K/V are the same bits however the
prompt was split, so a stored chain serves any prompt that begins with its tokens, even a prompt
cut into other segments by a template kvrag never saw, up to the first token where they differ.
To find that chain cheaply, each deposit also writes small sealed records, one at every multiple
of `STRIDE` tokens its state covers, named by a hash chained over the prompt's tokens from
position 0 (and bound to the engine's key scope) and pointing at the state. A prompt computes the
same chained hashes and binary-searches the records (a few reads for thousands of tokens); the
chain found is restored with every usual check, compared token by token with the prompt, and
grafted up to where they part (the last state cut there: full-attention layers only, since a
sliding-window layer holds only its tail).

A record is only a hint: a forged or stale one at worst points at a chain whose verified tokens
do not match, and nothing is grafted from it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Sequence

from kvrag.stores.deadline import Deadline
from kvrag.trust.records import SealedRecords

__all__ = ["STRIDE", "PrefixRecords", "PrefixHint", "common_prefix", "prefix_marks"]

#: prompt positions between two prefix records
STRIDE = 64
_MAX_RECORD_BYTES = 256


@dataclass(frozen=True)
class PrefixHint:
    """A stored state whose chain covers the prompt's first `position` tokens (unverified)."""

    position: int
    key: str


def prefix_marks(scope: str, ids: Sequence[int]) -> list[tuple[int, str]]:
    """(position, record name) at every multiple of STRIDE up to len(ids)."""
    digest = hashlib.sha256(b"kvrag-prefix\0" + scope.encode()).digest()
    marks = []
    for end in range(STRIDE, len(ids) + 1, STRIDE):
        digest = hashlib.sha256(digest + struct.pack(f"<{STRIDE}Q", *ids[end - STRIDE : end])).digest()
        marks.append((end, f"prefix/{digest.hex()}"))
    return marks


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixRecords:
    """Sealed records at every mark of a stored chain, pointing at the state that holds it."""

    def __init__(self, records: SealedRecords, scope: str) -> None:
        self.records = records
        self.scope = scope

    def record(self, ids: Sequence[int], start: int, key: str) -> None:
        """Point every mark in (start, len(ids)] at `key`, the state of ids[start:] after its chain,
        and the last mark at or before `start` too: a state that holds no mark of its own (shorter
        than the interval) is then found from there, and so is any state it is cut inside (its chain
        is compared with the prompt token by token, so a deeper state serves every shorter prefix)."""
        body = json.dumps({"key": key}).encode()
        marks = prefix_marks(self.scope, ids)
        before = [mark for mark in marks if mark[0] <= start][-1:]
        for _position, name in before + [mark for mark in marks if mark[0] > start]:
            self.records.put(name, body)

    def longest(self, ids: Sequence[int], deadline: Deadline | None = None) -> PrefixHint | None:
        """The hint for the longest marked prefix of `ids` (binary search: marks of one chain are
        all present up to its end), or None."""
        marks = prefix_marks(self.scope, ids)
        best: PrefixHint | None = None
        low, high = 0, len(marks)
        while low < high:
            mid = (low + high) // 2
            key = self._read(marks[mid][1], deadline)
            if key is None:
                high = mid
            else:
                best, low = PrefixHint(marks[mid][0], key), mid + 1
        return best

    def _read(self, name: str, deadline: Deadline | None) -> str | None:
        body = self.records.get(name, deadline)
        if body is None or len(body) > _MAX_RECORD_BYTES:
            return None
        try:
            key = json.loads(body)["key"]
        except (ValueError, KeyError, TypeError):
            return None
        if not isinstance(key, str) or len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            return None
        return key
