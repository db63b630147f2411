"""What `ChatKVRAG` and `KVRagLLM` share: the engine they run on (given, or opened once on first
use from the model and store fields) and the decoding options a call passes to it."""

from __future__ import annotations

import threading
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from kvrag import KVEngine

__all__ = ["KVEngineFields"]


class KVEngineFields(BaseModel):
    """The engine and decoding fields of a kvrag LangChain model (a mixin before the LangChain base)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    engine: KVEngine | None = Field(default=None, exclude=True)
    model_name: str = Field(default="smollm2-135m", alias="model")
    store: str | None = None
    dtype: str | None = None
    attn: str | None = None
    max_tokens: int = 64
    stop: list[str] | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    deposit_missing: bool = True
    graft: bool = True  # False: re-read every document as text, same tokens and segments (plain text RAG)
    _opened: KVEngine | None = PrivateAttr(default=None)
    _opening: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @property
    def _llm_type(self) -> str:
        return "kvrag"

    def _engine(self) -> KVEngine:
        if self.engine is not None:
            return self.engine
        with self._opening:  # built once, on first use (never in the constructor), even under `batch`
            if self._opened is None:
                self._opened = KVEngine.open(self.model_name, self.store, dtype=self.dtype, attn=self.attn)
        return self._opened

    @property
    def _identifying_params(self) -> dict[str, Any]:
        engine = self._engine()
        return {"model_name": engine.model.name, "model_fingerprint": engine.fingerprint, "store": engine.store.url}

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The engine's options for one call: the fields, overridden by the call's `stop` and kwargs."""
        return {
            "max_new_tokens": int(kwargs.get("max_tokens", self.max_tokens)),
            "stop": stop if stop is not None else self.stop,
            "graft": self.graft,
            "deposit_missing": self.deposit_missing and self.graft,
            **{name: kwargs.get(name, getattr(self, name)) for name in ("temperature", "top_p", "top_k", "seed")},
        }
