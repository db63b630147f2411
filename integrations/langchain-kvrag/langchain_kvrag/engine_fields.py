"""What `ChatKVRAG` and `KVRagLLM` share: the engine they run on (given, or opened once on first
use from the model and store fields) and the decoding options a call passes to it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from kvrag import GenerationOptions, KVEngine
from kvrag.apps import EngineOpener, call_options
from kvrag.core import RAG_DEFAULTS, Order

__all__ = ["KVEngineFields"]


class KVEngineFields(BaseModel):
    """The engine and decoding fields of a kvrag LangChain model (a mixin before the LangChain base)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    engine: KVEngine | None = Field(default=None, exclude=True)
    model_name: str = Field(default="smollm2-135m", alias="model")
    store: str | None = None  # a store URL (kvrag.stores.open_store); default: the disk store
    signing_key_file: str | None = None  # the fleet's key file; default: kvrag's key order
    namespace: str | None = None  # a tenant: its key is derived from the signing key
    dtype: str | None = None
    attn: str | None = None
    max_tokens: int = 64
    stop: list[str] | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    deposit_missing: bool = RAG_DEFAULTS.deposit_missing  # deposit what was read as text, after the answer
    admit_after: int = RAG_DEFAULTS.admit_after  # ...once the same chain was read as text this many times
    deposit_in_background: bool = RAG_DEFAULTS.deposit_in_background  # ...on the engine's worker, off the answer's path
    graft: bool = True  # False: re-read every document as text, same tokens and segments (plain text RAG)
    order: Order = RAG_DEFAULTS.order  # the order documents are read in (kvrag.GenerationOptions)
    _opener: EngineOpener = PrivateAttr(default_factory=EngineOpener)

    @property
    def _llm_type(self) -> str:
        return "kvrag"

    def _engine(self) -> KVEngine:
        return self._opener.engine(self.engine, self.model_name, self.store, dtype=self.dtype, attn=self.attn,
                                   signing_key_file=self.signing_key_file, namespace=self.namespace)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        engine = self._engine()
        return {"model_name": engine.model.name, "model_fingerprint": engine.fingerprint, "store": engine.store.url}

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> GenerationOptions:
        """The engine's options for one call: the fields, overridden by the call's `stop` and kwargs."""
        fields = GenerationOptions(max_new_tokens=self.max_tokens, stop=tuple(self.stop) if self.stop else None,
                                   graft=self.graft, deposit_missing=self.deposit_missing, temperature=self.temperature,
                                   top_p=self.top_p, top_k=self.top_k, seed=self.seed, order=self.order,
                                   admit_after=self.admit_after, deposit_in_background=self.deposit_in_background)
        return call_options(fields, {**kwargs, "stop": stop})
