"""What every framework adapter shares: the engine it runs on (`EngineOpener`), a call's options
(`call_options`), stamping retrieved documents with their verified states, searching a small
in-memory corpus when no retriever is wrapped, and turning what a framework hands back (text plus
state key) into `generate` input. The adapters (`langchain_kvrag`,
`llama_index.*.kvrag`) only translate their framework's types to and from these.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

from kvrag.core.options import GenerationOptions
from kvrag.core.schedule import StateRef
from kvrag.engine.engine import KVEngine
from kvrag.errors import InputError
from kvrag.reuse.lexical import IndexedDoc, LexicalIndex
from kvrag.trust.signing import read_key_file

__all__ = ["STATE_KEY", "FINGERPRINT_KEY", "RECEIPT_KEY", "STATE_METADATA_KEYS", "Retrieved", "StateRetrieval",
           "states_for", "EngineOpener", "call_options"]

#: Metadata key holding a document's state key (a JSON-safe hex string, never a live object).
STATE_KEY = "kvrag_state_key"
#: Metadata key holding the fingerprint of the model the state was deposited with.
FINGERPRINT_KEY = "kvrag_model_fingerprint"
#: Where an answer's receipt goes in a framework's response metadata.
RECEIPT_KEY = "kvrag_receipt"
#: Metadata keys that are kvrag's own (hidden from prompts and embeddings where a framework can).
STATE_METADATA_KEYS = (STATE_KEY, FINGERPRINT_KEY)


@dataclass(frozen=True)
class Retrieved:
    """A retrieved document in framework-neutral form."""

    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    id: str | None = None
    score: float | None = None


class StateRetrieval:
    """Stamps retrieved documents with their states (deposited on first sight), and searches
    `documents` with kvrag's lexical index when the adapter wraps no retriever of its framework."""

    def __init__(self, engine: KVEngine, documents: Sequence[Retrieved] | None = None) -> None:
        self.engine = engine
        self._documents = list(documents) if documents is not None else None
        self._index: LexicalIndex | None = None

    def search(self, query: str, k: int) -> list[Retrieved]:
        if self._documents is None:
            raise InputError("this retriever needs a retriever to wrap or documents to search")
        if self._index is None:
            self._index = LexicalIndex([IndexedDoc(d.text, dict(d.metadata), d.id) for d in self._documents])
        return [Retrieved(d.text, dict(d.metadata), d.id, score) for d, score in self._index.search(query, k)]

    def stamp(self, found: Iterable[Retrieved]) -> list[Retrieved]:
        """Each document with its state key and fingerprint in metadata (id: the state key if none)."""
        stamped = []
        for doc in found:
            ref = self.engine.ensure(doc.text)
            metadata = {**doc.metadata, STATE_KEY: ref.key, FINGERPRINT_KEY: ref.model_fingerprint}
            stamped.append(replace(doc, metadata=metadata, id=doc.id or ref.key))
        return stamped


def states_for(engine: KVEngine, documents: Iterable[tuple[str, str | None]]) -> list[StateRef | str]:
    """`generate` input for documents a framework hands back as (text, state key or None): the
    engine's own ref where the key is its own, else the text (found by content where stored)."""
    return [engine.resolve(text, key or "") for text, key in documents]


class EngineOpener:
    """The engine an adapter runs on: the one it was given, or one opened on first use (never in
    the adapter's constructor) from a model name and store URL, once, even when several threads
    ask at the same time (a framework's `batch`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._opened: KVEngine | None = None

    def engine(self, given: KVEngine | None, model: str, store: str | None = None, *, dtype: str | None = None,
               attn: str | None = None, signing_key_file: str | None = None,
               namespace: str | None = None) -> KVEngine:
        """`given`, else the engine opened from these fields: the key in `signing_key_file` (else the
        library's order, `kvrag.trust.signing.resolve_signing_key`), the tenant `namespace`."""
        if given is not None:
            return given
        with self._lock:
            if self._opened is None:
                key = read_key_file(signing_key_file) if signing_key_file else None
                self._opened = KVEngine.open(model, store, dtype=dtype, attn=attn, signing_key=key, namespace=namespace)
        return self._opened


#: the keyword arguments of a framework call that override an adapter's options (OpenAI's and kvrag's names)
_CALL_OPTIONS = ("stop", "temperature", "top_p", "top_k", "seed")


def call_options(defaults: GenerationOptions, call: Mapping[str, Any]) -> GenerationOptions:
    """An adapter's options (`defaults`, from its fields) overridden by one call's keyword
    arguments: `max_new_tokens` or OpenAI's `max_tokens`, and `stop`, `temperature`, `top_p`,
    `top_k`, `seed` where given (not None). Other arguments are the framework's own."""
    changes: dict[str, Any] = {name: call[name] for name in _CALL_OPTIONS if call.get(name) is not None}
    limit = call.get("max_new_tokens", call.get("max_tokens"))
    if limit is not None:
        changes["max_new_tokens"] = int(limit)
    return defaults.replace(**changes)
