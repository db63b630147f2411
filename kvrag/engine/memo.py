"""The engine's memo: memoizing an answer runs its check (the memo state must reproduce the
answer's tokens) on the engine that answers, so it lives here, above `kvrag.reuse.memo`, which
holds the entries, their states and the continuations that recall them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from kvrag.core.continuation import Continuation
from kvrag.core.decoding import Generation, GenerationStream
from kvrag.core.deposit import Depositor
from kvrag.core.restore import Restorer
from kvrag.core.schedule import Planner
from kvrag.errors import VerificationError
from kvrag.reuse.memo import MEMO_TAIL_TOKENS, Memo, MemoEntry, Provenance
from kvrag.trust.identity import EngineIdentity
from kvrag.trust.records import SealedRecords

if TYPE_CHECKING:
    from kvrag.core.schedule import StateRef

__all__ = ["EngineMemo"]


class EngineMemo(Memo):
    """`Memo` with memoizing: each check continuation is run by `run` (the engine's)."""

    def __init__(self, identity: EngineIdentity, planner: Planner, records: SealedRecords, depositor: Depositor,
                 restorer: Restorer, run: Callable[[Continuation], GenerationStream], *, vocabulary: int,
                 deadline_s: float) -> None:
        super().__init__(identity, planner, records, depositor, restorer, vocabulary=vocabulary, deadline_s=deadline_s)
        self._run = run

    def memoize(
        self,
        query: str,
        generation: "Generation",
        *,
        states: Sequence["StateRef | str"] = (),
        provenance: Provenance | None = None,
        verified: bool = True,
    ) -> MemoEntry:
        """Store `generation` (an answer to `query` after `states`) as a memo entry."""
        return self._memoize(query, [t for t in generation.tokens if t not in self.planner.layout.stop_ids],
                             generation.text, generation.finish_reason == "stop", states, provenance, verified, MEMO_TAIL_TOKENS)

    def memoize_text(
        self,
        query: str,
        answer: str,
        *,
        provenance: Provenance,
        states: Sequence["StateRef | str"] = (),
        decode_suffix: str | None = None,
    ) -> MemoEntry:
        """Memoize a verified answer written by someone else (a library solution).

        With `decode_suffix` (the final answer that ends `answer`), recall decodes those tokens
        if the model reproduces them exactly; otherwise the whole answer comes from the state.
        """
        ids = self.planner.layout.tokenize(answer)
        if decode_suffix and answer.rstrip().endswith(decode_suffix.strip()):
            tail = len(self.planner.layout.tokenize(decode_suffix.strip()))
            try:
                return self._memoize(query, ids, answer, False, states, provenance, True, tail)
            except VerificationError:
                pass
        return self._memoize(query, ids, answer, False, states, provenance, True, 0)

    def _memoize(self, query: str, answer_ids: list[int], answer: str, ended: bool,
                 states: Sequence["StateRef | str"], provenance: Provenance | None, verified: bool, tail: int) -> MemoEntry:
        entry, check = self.prepare(query, answer_ids, answer, ended, states, provenance, verified, tail)
        return self.keep(entry, None if check is None else self._run(check).result().tokens)
