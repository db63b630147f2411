"""Exact levers that raise reuse when retrieval returns several documents.

Exact reuse is prefix reuse: a chain state is only valid after its own ancestors, so top-k sets
that rarely repeat their order graft little beyond their first document. Each lever here is
opt-in and changes nothing about exactness (whatever is grafted equals a fresh computation of the
same schedule, and the text path reads the same schedule):

- `stored_prefix_first`: order the retrieved documents so the longest stored chain comes first.
  Order can change answers, so this is the user's choice; text and KV arms use the same order.
- `canonical_order`: the retrieved documents in one fixed order (by the SHA-256 of their text), so
  a set that recurs is the same chain whatever order the retriever returned it in, with no corpus to
  consult. Order can change answers, so this too is the user's choice.
- `CorpusChain`: for corpora that fit the model's context (cache-augmented generation), the whole
  corpus is one chain and every question reads all of it.
- `ChainWarmer`: co-retrieval statistics decide which chains will recur; they are deposited after
  answering (off the answer's critical path) within a byte and time budget.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections import Counter
from typing import Sequence

from kvrag.artifacts.format import parse_manifest
from kvrag.core.options import Order
from kvrag.core.protocol import Engine
from kvrag.core.schedule import StateRef
from kvrag.errors import ContextTooLongError, KVRagError
from kvrag.stores import UNTRUSTED_PARSE_ERRORS
from kvrag.stores.outages import log_failure
from kvrag.trust.confidential import open_manifest

__all__ = ["stored_prefix_first", "canonical_order", "reorder", "CorpusChain", "ChainWarmer", "MAX_ORDER_CHECKS"]

log = logging.getLogger("kvrag.reuse")

#: The most stored-state lookups one ordering may make (k! grows fast; the search stops there).
MAX_ORDER_CHECKS = 256


def canonical_order(texts: Sequence[str]) -> list[str]:
    """`texts` ordered by the SHA-256 of their UTF-8 bytes: the same set, the same order."""
    return sorted(texts, key=_digest)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def reorder(engine: Engine, states: Sequence[StateRef | str], order: Order) -> list[StateRef | str]:
    """`states` (refs or texts) in `order` (`kvrag.core.options.Order`). A ref moved from the
    position it was deposited at is re-read as text there, as any ref placed elsewhere is."""
    states = list(states)
    texts = [s.text if isinstance(s, StateRef) else s for s in states]
    if order == "retrieval" or len(states) < 2:
        return states
    ordered = canonical_order(texts) if order == "canonical" else stored_prefix_first(engine, texts)
    pool: dict[str, list[StateRef | str]] = {}
    for text, state in zip(texts, states):
        pool.setdefault(text, []).append(state)
    return [pool[text].pop(0) for text in ordered]


def stored_prefix_first(engine: Engine, texts: Sequence[str]) -> list[str]:
    """`texts` reordered so that the longest chain of them already stored comes first, the rest
    after it in their given order. Ties keep the given order (the first found wins)."""
    texts = list(texts)
    best: list[int] = []
    checks = 0

    def extend(chain: list[int], after: StateRef | None) -> None:
        nonlocal best, checks
        if len(chain) > len(best):
            best = list(chain)
        for index in range(len(texts)):
            if index in chain or checks >= MAX_ORDER_CHECKS or len(best) == len(texts):
                continue
            checks += 1
            ref = engine.ref(texts[index], after=after)
            if engine.holds(ref):
                extend([*chain, index], ref)

    extend([], None)
    return [texts[i] for i in best] + [t for i, t in enumerate(texts) if i not in best]


class CorpusChain:
    """A whole corpus deposited as one chain: every question grafts all of it."""

    def __init__(self, engine: Engine, texts: Sequence[str]) -> None:
        self.texts = list(texts)
        segments = engine.plan(self.texts)  # raises ContextTooLongError when the corpus does not fit
        room = engine.model.max_positions - (segments[-1].end if segments else 0)
        if room < 64:
            raise ContextTooLongError(
                f"a corpus of {len(self.texts)} documents leaves {room} of {engine.model.max_positions} positions for "
                "the question and answer; use retrieval (top-k) instead of a corpus chain"
            )
        self.refs = engine.deposit_chain(self.texts)


class ChainWarmer:
    """Deposits, after an answer, the chains that co-retrieval statistics say will recur.

    Every pair of documents retrieved together `min_count` times gets both of its orders
    deposited as chains (the order it was asked in is usually stored already by
    `deposit_missing`; the other is what a later question retrieving the same pair the other way
    round needs), within `budget_mib` of new state bytes and `budget_s` of deposit time per
    `drain`. `observe` only counts; `drain` deposits (call it when no answer is waiting, or use
    `start` for a background thread)."""

    def __init__(self, engine: Engine, *, min_count: int = 2, budget_mib: float = 256, budget_s: float = 10.0) -> None:
        self.engine = engine
        self.min_count = min_count
        self.budget_bytes = int(budget_mib * 2**20)
        self.budget_s = budget_s
        self.pairs: Counter[tuple[str, str]] = Counter()
        self.deposited_bytes = 0
        self.deposited_chains = 0
        self._queue: list[tuple[str, str]] = []
        self._done: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()

    def observe(self, texts: Sequence[str]) -> None:
        with self._lock:
            for a, b in itertools.combinations(sorted(set(texts)), 2):
                self.pairs[(a, b)] += 1
                if self.pairs[(a, b)] == self.min_count:
                    self._queue += [(a, b), (b, a)]
        self._wake.set()

    def drain(self) -> int:
        """Deposit queued chains within the budgets; returns how many were deposited."""
        began, count = time.perf_counter(), 0
        while time.perf_counter() - began < self.budget_s and self.deposited_bytes < self.budget_bytes:
            with self._lock:
                if not self._queue:
                    break
                pair = self._queue.pop(0)
            if pair in self._done:
                continue
            self._done.add(pair)
            refs = [self.engine.ref(pair[0])]
            refs.append(self.engine.ref(pair[1], after=refs[0]))
            if all(self.engine.holds(r) for r in refs):
                continue
            try:
                refs = self.engine.deposit_chain(list(pair))
            except KVRagError as e:  # a warm-up never fails an answer
                log_failure(log, "could not warm a chain: %s", e, error=e)
                continue
            self.deposited_bytes += sum(self._bytes(r) for r in refs)
            self.deposited_chains += 1
            count += 1
        return count

    def start(self) -> threading.Thread:
        """Drain in a daemon thread whenever something was observed."""

        def loop() -> None:
            while True:
                self._wake.wait()
                self._wake.clear()
                self.drain()

        thread = threading.Thread(target=loop, name="kvrag-chain-warmer", daemon=True)
        thread.start()
        return thread

    def _bytes(self, ref: "StateRef") -> int:
        """The state's payload size, for the budget (its manifest, as this engine wrote it)."""
        try:
            raw = self.engine.store.read_manifest(ref.key)
            return parse_manifest(open_manifest(raw, self.engine.signing_key, ref.key)).payload_bytes if raw else 0
        except (KVRagError, *UNTRUSTED_PARSE_ERRORS):
            return 0
