"""Every error kvrag raises, in one tree, grouped by what the caller can do about it.

    KVRagError                      root: catch this to catch everything kvrag raises
    ├── InputError                  the caller passed something unusable; fix the call
    │   ├── EmptyTextError          a document or query with no tokens
    │   └── ContextTooLongError     the prompt would pass the model's maximum positions
    ├── ModelError                  a model cannot be loaded or built; check the name or install
    ├── VerificationError           a deposit did not reproduce a fresh computation; nothing was
    │                               stored; check that the model runs deterministically here
    ├── StateError                  a stored state must not be grafted; the engine re-reads its text
    │   ├── StateNotFoundError      no state under that key in any tier            reason "missing"
    │   ├── IntegrityError          bytes that do not match their digests, or do   reason "integrity"
    │   │   │                       not parse
    │   │   └── SignatureError      unsigned, or signed with another key            reason "signature"
    │   ├── ForeignStateError       another model, hardware, chain or position     reason "foreign"
    │   └── StoreUnavailableError   a tier failed while the state was read         reason "unavailable"
    │                               (also a StoreError)
    └── StoreError                  a store URL is wrong, or a store failed to read or write

A `StateError` carries the receipt reason it is written as (`StateError.reason`); the set of
reasons a receipt can hold is `kvrag.core.receipt.Reason`. The explicit state APIs
(`KVEngine.restore`, `KVEngine.deposit(after=...)`) raise `StateError`s; `generate` never does,
it falls back to the text.
"""

from __future__ import annotations

__all__ = [
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
]


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
    """A deposit whose grafted state did not reproduce a fresh computation; nothing was stored."""


class StateError(KVRagError):
    """A stored state that must not be grafted. The engine falls back to re-reading its text."""

    #: the receipt reason (one of `kvrag.core.receipt.Reason`)
    reason: str = "integrity"


class StateNotFoundError(StateError):
    """No tier holds the state, or a part of it (payload, frame) is gone."""

    reason = "missing"


class IntegrityError(StateError):
    """Stored bytes that do not match their digests, do not parse, or were never verified."""

    reason = "integrity"


class SignatureError(IntegrityError):
    """A state or record that is unsigned, or signed with another key."""

    reason = "signature"


class ForeignStateError(StateError):
    """A state of another model, other hardware, or another chain or position."""

    reason = "foreign"


class StoreError(KVRagError):
    """A store URL kvrag cannot open, or a store that fails while reading or writing."""


class StoreUnavailableError(StoreError, StateError):
    """A tier failed while a state was read from it; the engine moves on to the next tier or the text."""

    reason = "unavailable"
