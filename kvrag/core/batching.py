"""Continuous batching: the prompt reads and decoding steps of concurrent generations over one
model advance together.

Each generation runs on its own thread, as alone: its store reads and grafts, its prompt reads,
then its decoding loop. Each read and step it asks for goes to the batcher, whose thread runs one
forward over every waiting generation's rows (`ModelRunner.step_many`: a step is one row, a read
its prompt's rows) and hands each its logits; so a new request's prompt read joins the next
forward of the answers under way instead of waiting for them. A generation joins at its first
read and leaves when its loop ends (an answer finished, stopped or abandoned), so the batch
changes from one forward to the next.

Exact by construction: under the invariant kernel a linear layer's row has the same bits among any
number of rows, and attention stays per generation, over its own cache; so every answer equals,
token for token and in its logits' bits, the same request served alone. Where that does not hold
(another attention kernel, a linear arithmetic whose rows depend on the count), the steps still
take turns here but each is its own forward; so does a prompt read of a model with sliding-window
layers. A prompt that needs the model otherwise (a blend) holds it between two batch forwards (`turn`);
so does every forward from outside the batch (a deposit, a memo check): the model's turns
(`kvrag.models.turns`) run one forward at a time, fairly.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from kvrag.codecs import GraftCache
from kvrag.core.runner import DecodeStep, ModelRunner, PromptRead

__all__ = ["Batcher", "Batching", "Lane"]

#: how long a step waits for the rest of the batch (generations between two steps) before it runs
#: without them: long enough for a thread to pass a token on, short beside a forward
GATHER_S = 0.005
#: how long a background read (a deposit's) waits for the batch to have no answer under way before
#: it joins the answers' forwards anyway: deposits use idle time, and are not starved by a busy one
BACKGROUND_WAIT_S = 2.0


class Lane:
    """One generation's place in the batch: `step` and `read` block until the batch forward that
    carries them is done. A `background` lane's reads (a deposit's) run only in a forward no answer
    waits on, or once it has waited `BACKGROUND_WAIT_S`."""

    def __init__(self, batcher: "Batcher", background: bool = False) -> None:
        self._batcher = batcher
        self.background = background
        self.logits: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.asked = 0.0  # when its step or read began to wait

    def step(self, step: DecodeStep) -> torch.Tensor:
        return self._batcher._step(self, step)

    def read(self, ids: Sequence[int], cache: Any) -> torch.Tensor:
        """Feed prompt `ids` after what `cache` holds, in the next batch forward (`ModelRunner.forward`'s logits)."""
        if isinstance(cache, GraftCache):  # a streamed graft arrives here, not in the batch's forward
            cache.settle()
        return self._batcher._step(self, PromptRead(list(ids), cache))


class Batcher:
    """The batch of one model: at most `rows` generations' steps per forward."""

    def __init__(self, runner: ModelRunner, rows: int = 16, *, observe: Callable[[int], None] | None = None) -> None:
        self.runner, self.rows = runner, rows
        #: told each forward's row count (the server's metrics)
        self._observe = observe
        self._cond = threading.Condition()
        self._members: set[Lane] = set()
        self._waiting: dict[Lane, DecodeStep | PromptRead] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        #: forward calls run for steps and reads, and the steps and reads they carried
        self.forwards = self.stepped_rows = 0

    @property
    def members(self) -> int:
        """Generations in the batch now (past their first read, not yet done)."""
        with self._cond:
            return len(self._members)

    @property
    def exact(self) -> bool:
        """Whether a batch's rows have the bits each has alone, so several share one forward."""
        return self.runner.batches_exactly

    def turn(self) -> AbstractContextManager[None]:
        """Hold the model between two batch forwards (for a prompt that needs it otherwise than to read)."""
        return self.runner.model.turns.turn()

    @contextmanager
    def lane(self, *, background: bool = False) -> Iterator[Lane]:
        """A generation's lane, for its prompt reads and decoding loop; leaving it frees the row at
        the next forward. A `background` lane (a deposit's reads) yields to the answers under way."""
        lane = Lane(self, background)
        try:
            yield lane
        finally:
            with self._cond:
                self._members.discard(lane)
                self._waiting.pop(lane, None)
                self._cond.notify_all()

    def _step(self, lane: Lane, step: DecodeStep | PromptRead) -> torch.Tensor:
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._start()
            lane.logits = lane.error = None
            lane.asked = time.monotonic()
            if not lane.background:  # the batch waits for its members' next steps, not for deposits
                self._members.add(lane)
            self._waiting[lane] = step
            self._cond.notify_all()
            while lane.logits is None and lane.error is None:
                self._cond.wait()
        if lane.error is not None:
            raise lane.error
        assert lane.logits is not None
        return lane.logits

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvrag-batch", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the batch thread once no step waits (generations still running then fail their next step)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _gather(self) -> list[tuple[Lane, DecodeStep | PromptRead]] | None:
        """The next batch (None: closed): once a step waits, up to `GATHER_S` for every other
        member's; background reads only while no answer is under way, or once they waited
        `BACKGROUND_WAIT_S`."""
        with self._cond:
            while not (ready := self._ready()) and not (self._closed and not self._waiting):
                self._cond.wait(self._patience())
            if not ready:
                return None
            until = time.monotonic() + GATHER_S
            while len(self._ready()) < min(len(self._members), self.rows) and (left := until - time.monotonic()) > 0:
                self._cond.wait(left)
            taken = self._ready()[: self.rows]
            for lane, _ in taken:
                del self._waiting[lane]
            return taken

    def _ready(self) -> list[tuple[Lane, DecodeStep | PromptRead]]:
        """What may run in the next forward: every answer's step or read, and the background reads
        once no answer is under way (or they waited long enough)."""
        now, idle = time.monotonic(), not self._members
        return [(lane, step) for lane, step in self._waiting.items()
                if not lane.background or idle or now - lane.asked >= BACKGROUND_WAIT_S]

    def _patience(self) -> float | None:
        """How long until the oldest background read may join a busy batch (None: none waits)."""
        asked = [lane.asked for lane in self._waiting if lane.background]
        return max(0.0, min(asked) + BACKGROUND_WAIT_S - time.monotonic()) if asked else None

    def _run(self) -> None:
        while (batch := self._gather()) is not None:
            try:
                logits = self.runner.step_many([step for _, step in batch])  # in the model's turn
                results: list[tuple[torch.Tensor | None, BaseException | None]] = [(row, None) for row in logits]
            except BaseException as e:  # noqa: BLE001 - handed to every generation in the batch
                results = [(None, e)] * len(batch)
            with self._cond:
                self.forwards += self.runner.forward_calls([step for _, step in batch])
                self.stepped_rows += len(batch)
                if self._observe is not None:
                    self._observe(len(batch))
                for (lane, _), (row, error) in zip(batch, results):
                    lane.logits, lane.error = row, error
                self._cond.notify_all()


class Batching:
    """Where a model's batch is set, once, for everything that runs forwards over it: a runtime
    holds one, and its engines' continuers and depositors read `batcher` at each use, so an engine
    made before the batch was set (or after) uses the same one. None: each forward alone."""

    def __init__(self) -> None:
        self.batcher: Batcher | None = None
