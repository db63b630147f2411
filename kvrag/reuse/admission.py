"""Which chains read as text earn a deposit: those the traffic shows recur.

A state earns its bytes by the prefill it saves, and a chain read once may never come back.
`Admission` counts, per chain (the key of its last segment, which names the whole chain), how
often it was read as text, and admits its deposit from the `after`-th reading on (1: the first).
The counts live in this process, bounded: the least recently counted are forgotten first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

from kvrag.core.schedule import Segment

__all__ = ["Admission", "MAX_COUNTED"]

#: chains counted at most (about 100 bytes each)
MAX_COUNTED = 100_000


class Admission:
    def __init__(self, max_counted: int = MAX_COUNTED) -> None:
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._max = max_counted
        self._lock = threading.Lock()

    def admit(self, segments: Sequence[Segment], after: int) -> bool:
        """Count one more reading of `segments` as text; whether that makes `after` readings."""
        if not segments:
            return False
        if after <= 1:
            return True
        key = segments[-1].key
        with self._lock:
            count = self._counts.pop(key, 0) + 1
            self._counts[key] = count
            while len(self._counts) > self._max:
                self._counts.popitem(last=False)
        return count >= after

    def count(self, segments: Sequence[Segment]) -> int:
        """How often `segments` were counted as read as text."""
        with self._lock:
            return self._counts.get(segments[-1].key, 0) if segments else 0
