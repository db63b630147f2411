"""One tokenizer, any thread. A fast tokenizer keeps its truncation and padding settings in its
Rust backend, and every call sets them before it encodes: two threads calling one tokenizer with
different settings read each other's (an untruncated call comes back truncated), or one fails
with "Already borrowed". The methods that set, encode, decode and look up ids run under one
reentrant lock per tokenizer, whoever calls them: kvrag's threads and a user's own calls on
`model.tokenizer` alike.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["thread_safe"]

#: the methods (of `transformers`' fast tokenizers) that use the backend; those a class lacks are skipped
_METHODS = ("_encode_plus", "_batch_encode_plus", "set_truncation_and_padding", "_decode",
            "_convert_token_to_id_with_added_voc", "_convert_id_to_token")


class _Guard:
    """A tokenizer's lock; a copy (pickled, deep-copied) gets a lock of its own."""

    def __init__(self) -> None:
        self.lock = threading.RLock()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.lock = threading.RLock()


class _Locked:
    """`owner`'s method `name` (its class's), called under `guard`'s lock."""

    def __init__(self, owner: Any, name: str, guard: _Guard) -> None:
        self.owner, self.name, self.guard = owner, name, guard

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.guard.lock:
            return getattr(type(self.owner), self.name)(self.owner, *args, **kwargs)


def thread_safe(tokenizer: Any) -> Any:
    """`tokenizer`, its backend's methods each called under its one lock (in place; idempotent)."""
    if isinstance(getattr(tokenizer, "_kvrag_guard", None), _Guard):
        return tokenizer
    guard = _Guard()
    for name in _METHODS:
        if callable(getattr(type(tokenizer), name, None)):
            setattr(tokenizer, name, _Locked(tokenizer, name, guard))
    tokenizer._kvrag_guard = guard
    return tokenizer
