"""The engine: `KVEngine`, the facade that wires an identity, a store and a model, and the
continuer that runs every continuation (grafts, reuse, text, the question, decoding)."""

from kvrag.engine.continuer import Continuer
from kvrag.engine.engine import KVEngine

__all__ = ["KVEngine", "Continuer"]
