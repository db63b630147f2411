"""kvrag: a language model's computed state as reusable, verified knowledge.

    >>> import kvrag
    >>> engine = kvrag.KVEngine(kvrag.load_model("smollm2-135m"))     # default disk store
    >>> ref = engine.deposit("The lighthouse at Varrow Point was built in 1871 by Mara Quill.")
    >>> answer = engine.generate("Who built the lighthouse?", states=[ref])
    >>> answer.text, answer.receipt.mode                              # doctest: +SKIP
    ('Mara Quill built it.', 'exact-graft')

Names are imported when first used, so `import kvrag` (and `kvrag --help`) does not load torch.
`kvrag.kernels.register()` (which `load_model` calls for the invariant kernel) registers it with
transformers by name; importing kvrag changes nothing outside it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvrag.errors import (
    ContextTooLongError,
    EmptyTextError,
    ForeignStateError,
    InputError,
    IntegrityError,
    KVRagError,
    ModelError,
    RedirectError,
    SignatureError,
    StateError,
    StateNotFoundError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
    StreamFailedError,
    VerificationError,
)
from kvrag.version import VERSION

if TYPE_CHECKING:
    from kvrag.apps import VerifyReport, verify_model
    from kvrag.artifacts import StateManifest
    from kvrag.core import (
        Continuation,
        Engine,
        Generation,
        GenerationOptions,
        GenerationStream,
        Message,
        Receipt,
        Segment,
        StateRef,
        StateUse,
        Timings,
    )
    from kvrag.engine import KVEngine, Runtime
    from kvrag.models import HardwareFingerprint, LoadedModel, ModelFingerprint, hardware_fingerprint, load_model
    from kvrag.reuse import Provenance
    from kvrag.stores import BlobStore, DiskStore, MemoryStore, RedisStore, StateStore, TieredStore, open_store
    from kvrag.trust import EngineIdentity


__version__ = VERSION

#: where each lazily imported name lives
_LAZY = {
    "kvrag.apps": ["VerifyReport", "verify_model"],
    "kvrag.artifacts": ["StateManifest"],
    "kvrag.core": ["Continuation", "Engine", "Generation", "GenerationOptions", "GenerationStream", "Message", "Receipt", "Segment",
                   "StateRef", "StateUse", "Timings"],
    "kvrag.engine": ["KVEngine", "Runtime"],
    "kvrag.models": ["HardwareFingerprint", "LoadedModel", "ModelFingerprint", "hardware_fingerprint", "load_model"],
    "kvrag.reuse": ["Provenance"],
    "kvrag.stores": ["BlobStore", "DiskStore", "MemoryStore", "RedisStore", "StateStore", "TieredStore", "open_store"],
    "kvrag.trust": ["EngineIdentity"],
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvrag' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "load_model",
    "LoadedModel",
    "KVEngine",
    "Runtime",
    "Engine",
    "GenerationOptions",
    "EngineIdentity",
    "Message",
    "Provenance",
    "StateRef",
    "Segment",
    "Continuation",
    "Generation",
    "GenerationStream",
    "Receipt",
    "StateUse",
    "Timings",
    "StateManifest",
    "ModelFingerprint",
    "HardwareFingerprint",
    "hardware_fingerprint",
    "open_store",
    "StateStore",
    "BlobStore",
    "DiskStore",
    "MemoryStore",
    "RedisStore",
    "TieredStore",
    "verify_model",
    "VerifyReport",
    "KVRagError",
    "InputError",
    "EmptyTextError",
    "ContextTooLongError",
    "ModelError",
    "StateError",
    "StateNotFoundError",
    "IntegrityError",
    "SignatureError",
    "ForeignStateError",
    "VerificationError",
    "StoreError",
    "StoreUnavailableError",
    "StoreTimeoutError",
    "StreamFailedError",
    "RedirectError",
]
