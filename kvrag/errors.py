"""Every error kvrag raises, in one tree, grouped by what the caller can do about it.

    KVRagError                      root: catch this to catch everything kvrag raises
    ├── InputError                  the caller passed something unusable; fix the call
    │   ├── EmptyTextError          a document or query with no tokens
    │   └── ContextTooLongError     the prompt would pass the model's maximum positions
    ├── ModelError                  a model cannot be loaded or built; check the name or install
    ├── VerificationError           a computation did not reproduce a fresh one (a deposit, a memo
    │                               entry, `kvrag verify`); nothing was stored
    ├── StateError                  a stored state must not be grafted; the engine re-reads its text
    │   │                           (carries `key`, `tier` and its receipt `reason`)
    │   ├── StateNotFoundError      no state under that key in any tier            reason "missing"
    │   ├── IntegrityError          bytes that do not match their digests, or do   reason "integrity"
    │   │   │                       not parse
    │   │   └── SignatureError      unsigned, or signed with another key            reason "signature"
    │   ├── ForeignStateError       another model, hardware, chain or position     reason "foreign"
    │   └── StoreUnavailableError   a tier is down: unreachable, timed out, or its reason "unavailable"
    │       │                       breaker open (also a StoreError; reported once per outage)
    │       └── StoreTimeoutError   the question's deadline for store reads passed
    ├── StreamFailedError           a streamed state failed after its graft began; the engine reads
    │                               the continuation again without streaming (never a StateError)
    └── StoreError                  a store URL is wrong, or a store failed to read or write
        └── RedirectError           a Redis Cluster node no longer serves the key's slot

A `StateError` carries the receipt reason it is written as (`StateError.reason`, one of `Reason`).
The explicit state APIs (`KVEngine.restore`, `KVEngine.deposit(after=...)`) raise `StateError`s;
`generate` never does, it falls back to the text.
"""

from __future__ import annotations

from typing import Literal, TypeVar

E = TypeVar("E", bound=BaseException)

__all__ = [
    "Reason",
    "KVRagError",
    "InputError",
    "EmptyTextError",
    "ContextTooLongError",
    "ModelError",
    "VerificationError",
    "StateError",
    "StateNotFoundError",
    "IntegrityError",
    "SignatureError",
    "ForeignStateError",
    "StoreError",
    "StoreUnavailableError",
    "StoreTimeoutError",
    "StreamFailedError",
    "RedirectError",
    "cause_of",
]

#: Why a segment was read as text, as a receipt says it: a `StateError`'s reason, or one of the
#: engine's own (`moved`: the state was deposited at other positions; `graft-off`: grafting was off).
Reason = Literal["missing", "integrity", "signature", "foreign", "unavailable", "moved", "graft-off"]


class KVRagError(Exception):
    """Root of every error kvrag raises."""


class InputError(KVRagError, ValueError):
    """The caller passed something kvrag cannot use; the message says what to change."""


class EmptyTextError(InputError):
    """A document or query that tokenizes to nothing."""


class ContextTooLongError(InputError):
    """The prompt would run past the model's maximum position embeddings."""


class ModelError(KVRagError):
    """A model name that kvrag cannot resolve, or a model it cannot load."""


class VerificationError(KVRagError):
    """A computation that did not reproduce a fresh one; nothing was stored."""


class StateError(KVRagError):
    """A stored state that must not be grafted. The engine falls back to re-reading its text.

    `key` is the state's key and `tier` the URL of the tier that refused it, where known (a
    tier fills both in when it raises)."""

    #: the receipt reason this error is written as
    reason: Reason = "integrity"

    def __init__(self, message: str, *, key: str | None = None, tier: str | None = None) -> None:
        super().__init__(message)
        self.key, self.tier = key, tier

    def located(self, key: str | None = None, tier: str | None = None) -> "StateError":
        """This error with its key and tier filled in where they were not known yet."""
        self.key, self.tier = self.key or key, self.tier or tier
        return self


class StateNotFoundError(StateError):
    """No tier holds the state, or a part of it (payload, frame) is gone."""

    reason: Reason = "missing"


class IntegrityError(StateError):
    """Stored bytes that do not match their digests, do not parse, or were never verified."""

    reason: Reason = "integrity"


class SignatureError(IntegrityError):
    """A state or record that is unsigned, or signed with another key."""

    reason: Reason = "signature"


class ForeignStateError(StateError):
    """A state of another model, other hardware, or another chain or position."""

    reason: Reason = "foreign"


class StoreError(KVRagError):
    """A store URL kvrag cannot open, or a store that fails while reading or writing."""


class StoreUnavailableError(StoreError, StateError):
    """A tier is down (it cannot be reached, timed out, or its breaker is open): a read moves on to
    the next tier or the text, a write is skipped. The outage was already reported, once
    (`kvrag.stores.outages`): whoever catches this need not warn again."""

    reason: Reason = "unavailable"


class StoreTimeoutError(StoreUnavailableError):
    """A store read that did not end within the question's deadline (or the tier's breaker is open
    after one that did not)."""


class StreamFailedError(KVRagError):
    """A streamed state failed after its graft began: the continuation is read again without
    streaming. Not a `StateError`: no handler of one state's miss may take it for its own."""

    def __init__(self, key: str, cause: StateError) -> None:
        super().__init__(f"state {key[:12]} failed while streamed: {cause}")
        self.key, self.cause = key, cause


class RedirectError(StoreError):
    """The cluster node no longer serves the key's slot (`MOVED`/`ASK`): redis-py, which follows
    redirections and refreshes its slot map, reads it instead."""


def cause_of(error: BaseException, kind: type[E]) -> E | None:
    """`error` itself or the first error in its cause chain that is a `kind` (None if none is),
    looking 8 deep at most (a chain is not followed forever)."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None or isinstance(seen, kind):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
