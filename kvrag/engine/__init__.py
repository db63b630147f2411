"""The engine: `KVEngine`, the facade that wires an identity, a store and a model; the `Runtime`
engines over one model share (its runner, buffer pool, deposit worker and batch); and the
continuer that runs every continuation (grafts, reuse, text, the question, decoding)."""

from kvrag.engine.continuer import Continuer
from kvrag.engine.engine import KVEngine
from kvrag.engine.runtime import Runtime

__all__ = ["KVEngine", "Runtime", "Continuer"]
