"""The model's one lock: every forward over a loaded model runs in its turn, whoever asks (an
answer's read or step, the batch, a deposit and its canary, a memo or gate check, `verify`'s stock
passes), so no two forwards ever run over one model at once, whatever threads and engines share it.

Turns are fair (first asked, first served), so a long deposit cannot starve the batch or the
batch a deposit; and reentrant, so a thread that holds the model (the batch's forward, a blend's
prompt) runs its forwards inside its own turn.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["Turns"]


class Turns:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = self._serving = 0
        self._owner: int | None = None
        self._depth = 0
        #: turns taken, and turns that found the model busy and waited (a measure of contention)
        self.taken = self.waited = 0

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the model until the block ends, after every thread that asked before."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
            else:
                ticket, self._next = self._next, self._next + 1
                self.taken += 1
                if ticket != self._serving:
                    self.waited += 1
                while ticket != self._serving:
                    self._cond.wait()
                self._owner, self._depth = me, 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = None
                    self._serving += 1
                    self._cond.notify_all()

    @property
    def held(self) -> bool:
        """Whether the calling thread holds the model now."""
        return self._owner == threading.get_ident()
