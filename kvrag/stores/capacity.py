"""What a bounded tier drops first when it is full.

A state earns its bytes by the prefill it saves. For one model both grow with the state's tokens,
so byte for byte states differ by how often they are used. `value` ranks them by their hits, each
hit weighing half as much every `half_life_s` (a deposit counts as the first hit, so a new state
is not the first to go); `lru` ranks them by their last use alone. Ties go to the least recently
used.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Literal, get_args

from kvrag.errors import StoreError

__all__ = ["Eviction", "Uses", "DEFAULT_HALF_LIFE_S", "capacity_params"]

Eviction = Literal["lru", "value"]
DEFAULT_HALF_LIFE_S = 3600.0
_GIB = 1 << 30
_MIB = 1 << 20


@dataclass
class _Use:
    score: float  # recency-weighted hits as of `at`
    at: float  # wall-clock time of the last hit


class Uses:
    """Recency-weighted hits per entry, and the order a full tier drops entries in (thread-safe).

    Hits are counted in this process; `last_used` times passed to `order` (a file's access time,
    say) may come from other processes too."""

    def __init__(self, eviction: Eviction = "lru", half_life_s: float = DEFAULT_HALF_LIFE_S) -> None:
        if eviction not in get_args(Eviction):
            raise StoreError(f"evict= takes lru or value, not {eviction!r}")
        if not half_life_s > 0:
            raise StoreError("half_life_s must be more than 0 seconds")
        self.eviction = eviction
        self.half_life_s = half_life_s
        self._uses: dict[object, _Use] = {}
        self._lock = threading.Lock()

    def hit(self, entry: object, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            use = self._uses.get(entry)
            self._uses[entry] = _Use(1.0 + (self._decayed(use, now) if use else 0.0), now)

    def forget(self, entry: object) -> None:
        with self._lock:
            self._uses.pop(entry, None)

    def score(self, entry: object, now: float | None = None) -> float:
        """The entry's hits, each weighted by how recent it is (0.0 for one never seen here)."""
        now = time.time() if now is None else now
        with self._lock:
            use = self._uses.get(entry)
            return self._decayed(use, now) if use else 0.0

    def _decayed(self, use: _Use, now: float) -> float:
        return use.score * math.exp2(-max(0.0, now - use.at) / self.half_life_s)

    def order(self, entries: Iterable[tuple[object, float]], now: float | None = None) -> list[object]:
        """`(entry, last_used)` pairs, the first to drop first."""
        now = time.time() if now is None else now
        pairs = list(entries)
        if self.eviction == "lru":
            return [e for e, _ in sorted(pairs, key=lambda p: p[1])]
        return [e for e, _ in sorted(pairs, key=lambda p: (self.score(p[0], now), p[1]))]


def capacity_params(params: dict[str, str], *, size_name: str) -> tuple[int | None, Eviction, float]:
    """`(max_bytes, eviction, half_life_s)` from a tier URL's query: `max_gib`/`max_mib` (whichever
    `size_name` is), `evict=lru|value` and `half_life_s`."""
    unit = {"max_gib": _GIB, "max_mib": _MIB}[size_name]
    max_bytes = None
    if size_name in params:
        try:
            amount = float(params[size_name])
        except ValueError:
            raise StoreError(f"{size_name} must be a number, not {params[size_name]!r}") from None
        if not 0 < amount <= (1 << 50) / unit:
            raise StoreError(f"{size_name} must be more than 0")
        max_bytes = max(1, int(amount * unit))
    eviction = params.get("evict", "lru")
    if eviction not in get_args(Eviction):
        raise StoreError(f"evict= takes lru or value, not {eviction!r}")
    try:
        half_life_s = float(params.get("half_life_s", DEFAULT_HALF_LIFE_S))
    except ValueError:
        raise StoreError(f"half_life_s must be a number of seconds, not {params['half_life_s']!r}") from None
    if not half_life_s > 0 or math.isinf(half_life_s):
        raise StoreError("half_life_s must be a number of seconds more than 0")
    return max_bytes, eviction, half_life_s  # type: ignore[return-value]
