"""kvrag: a language model's computed state as reusable, verified knowledge.

    >>> import kvrag
    >>> engine = kvrag.KVEngine(kvrag.load_model("smollm2-135m"))     # default disk store
    >>> ref = engine.deposit("The lighthouse at Varrow Point was built in 1871 by Mara Quill.")
    >>> answer = engine.generate("Who built the lighthouse?", states=[ref])
    >>> answer.text, answer.receipt.mode                              # doctest: +SKIP
    ('Mara Quill built it.', 'exact-graft')
"""

from kvrag.apps import VerifyReport, verify_model
from kvrag.artifacts import StateManifest
from kvrag.core import (
    Continuation,
    Engine,
    Generation,
    GenerationStream,
    Message,
    Receipt,
    Segment,
    StateRef,
    StateUse,
    Timings,
)
from kvrag.engine import KVEngine
from kvrag.errors import (
    ContextTooLongError,
    EmptyTextError,
    ForeignStateError,
    InputError,
    IntegrityError,
    KVRagError,
    ModelError,
    SignatureError,
    StateError,
    StateNotFoundError,
    StoreError,
    StoreUnavailableError,
    VerificationError,
)
from kvrag.kernels import register as _register_invariant
from kvrag.models import HardwareFingerprint, LoadedModel, ModelFingerprint, hardware_fingerprint, load_model
from kvrag.reuse import Provenance
from kvrag.stores import BlobStore, DiskStore, MemoryStore, RedisStore, StateStore, TieredStore, open_store
from kvrag.trust import EngineIdentity

__version__ = "0.1.0"

# `attn_implementation="invariant"` works in stock transformers code once kvrag is imported.
_register_invariant()

__all__ = [
    "load_model",
    "LoadedModel",
    "KVEngine",
    "Engine",
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
]
