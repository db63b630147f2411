"""The runtime: one loaded model and what runs it, shared by every engine over it.

An engine is a view: its own store, signing key and namespace over a runtime's model. The runtime
holds what there must be one of per model: the runner (every forward in the model's turn,
`kvrag.models.turns`), the pool of kept graft buffers, the deposit worker and, in a server, the
batch every generation's reads and steps share. So the tenants of `kvrag serve` share one pool,
one deposit thread and one batch, and no two forwards ever run over the model at once.
"""

from __future__ import annotations

from types import TracebackType

from kvrag.codecs import ReadyBuffers
from kvrag.codecs.ready import DEFAULT_READY_BYTES
from kvrag.core.batching import Batcher, Batching
from kvrag.core.runner import ModelRunner
from kvrag.kernels.attention import INVARIANT
from kvrag.models.loading import LoadedModel
from kvrag.reuse.deposit_queue import DepositQueue

__all__ = ["Runtime"]


class Runtime:
    """A loaded model, its runner, kept-buffer pool (`ready_buffers_bytes`, under the invariant
    kernel), deposit worker and optional batch. `close()` (or leaving a `with` block) runs the
    deposits queued, then ends the worker and the batch."""

    def __init__(self, model: LoadedModel, *, ready_buffers_bytes: int = DEFAULT_READY_BYTES) -> None:
        self.model = model
        self.runner = ModelRunner(model)
        #: whole-block buffers of grafted states, kept for the next question over the same bytes
        self.ready = ReadyBuffers(ready_buffers_bytes) if model.attn == INVARIANT else None
        #: deposits after answers, off their path; each job carries its own engine's deposit
        self.deposits = DepositQueue(None, bytes_per_token=model.state_bytes_per_token)
        #: the generations' reads and steps, several per forward (`kvrag serve`), for every engine over it
        self.batching = Batching()

    @property
    def batcher(self) -> Batcher | None:
        """The batch every engine over this runtime uses (None: each forward alone)."""
        return self.batching.batcher

    @batcher.setter
    def batcher(self, batcher: Batcher | None) -> None:
        self.batching.batcher = batcher

    def close(self, timeout: float | None = None) -> bool:
        """Take no more deposits; run those queued (at most `timeout` seconds, default the queue's
        `max_wait_s`); end the batch. False if some deposits were left."""
        finished = self.deposits.close(timeout)
        if self.batcher is not None:
            self.batcher.close()
        return finished

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.close()
