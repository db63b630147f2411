"""Every error kvrag raises, in one small hierarchy.

    KVRagError                      root: catch this to catch everything kvrag raises
    ├── InputError                  the caller passed something unusable; fix the call
    │   ├── EmptyTextError          a document or query with no tokens
    │   └── ContextTooLongError     the prompt would pass the model's maximum positions
    ├── ModelError                  a model cannot be loaded or built; check the name or install
    ├── StateError                  a stored state cannot be grafted; the engine falls back to text
    │   ├── StateNotFoundError      no state under that key in any tier
    │   ├── IntegrityError          a payload or manifest does not match its recorded digests
    │   ├── ForeignStateError       a state of another model, hardware, chain or position
    │   ├── VerificationError       a deposit did not reproduce a fresh computation; nothing stored
    │   └── StoreUnavailableError   a tier could not be reached (also a StoreError)
    └── StoreError                  a store URL is wrong or a store cannot be reached

`StateError`s are what the engine turns into a text fallback (and names in the receipt);
the explicit state APIs (`KVEngine.restore`, `KVEngine.deposit(after=...)`) raise them.
"""

from __future__ import annotations

__all__ = [
    "KVRagError",
    "InputError",
    "EmptyTextError",
    "ContextTooLongError",
    "ModelError",
    "StateError",
    "StateNotFoundError",
    "IntegrityError",
    "ForeignStateError",
    "VerificationError",
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


class StateError(KVRagError):
    """A stored state that must not be grafted. The engine falls back to re-reading its text."""

    #: short machine-readable reason, written into receipts
    reason: str = "state-error"


class StateNotFoundError(StateError):
    reason = "missing"


class IntegrityError(StateError):
    reason = "integrity"


class ForeignStateError(StateError):
    reason = "foreign"


class VerificationError(StateError):
    reason = "unverified"


class StoreError(KVRagError):
    """A store URL kvrag cannot open, or a store that fails while reading or writing."""


class StoreUnavailableError(StoreError, StateError):
    """A tier failed while a state was read from it; the engine moves on to the next tier or the text."""

    reason = "unavailable"
