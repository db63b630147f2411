"""A paged engine's KV blocks in any kvrag store: chained, signed, checked, scoped to one tenant.

A block's key is the state key of its tokens after its parent block, in a scope that names the
signing key, the engine's settings and the namespace: identical work maps to one key, other
engines and other tenants never meet it. What a load returns passed every check kvrag makes on a
state (signature over the stored bytes, the manifest's chain, engine and layout, each chunk's keyed
tag); a load that fails says why (`StateError.reason`), and the refusals are counted by reason.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvrag.artifacts.digests import chunk_digests, open_payload
from kvrag.artifacts.format import state_key
from kvrag.artifacts.payloads import chunking_of, seal_payload
from kvrag.errors import ForeignStateError, IntegrityError, StateError
from kvrag.paged.blocks import (
    BLOCK_FORMAT,
    BlockEngine,
    BlockLayer,
    BlockManifest,
    block_payload,
    block_tensors,
    parse_block_manifest,
)
from kvrag.stores.base import Accepted, Receive, StateStore
from kvrag.stores.deadline import Deadline
from kvrag.trust.identity import key_scope
from kvrag.trust.signing import check_manifest_bytes, sign_manifest_bytes
from kvrag.trust.tenants import key_for

__all__ = ["Block", "BlockStats", "LoadedBlock", "LoadedRun", "BlockStore"]


@dataclass(frozen=True)
class Block:
    """One full block of a prompt: its tokens, where it starts, and the block before it."""

    key: str
    parent_key: str | None
    start: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class LoadedBlock:
    """A block's layer tensors (views over checked, read-only bytes: copy them out) and its tier."""

    tensors: list[torch.Tensor]
    tier: str


@dataclass
class LoadedRun:
    """What `BlockStore.load_run` did: blocks that landed (from the first), by tier, and the error
    that stopped it (None: every block landed)."""

    landed: int = 0
    tiers: Counter[str] = field(default_factory=Counter)
    error: StateError | None = None


@dataclass
class BlockStats:
    """What a block store did since it opened: blocks saved, loaded (by tier), refused (by reason)."""

    saved: int = 0
    loaded: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)


class _Acceptance:
    """A block's checks, in order: signature over the stored bytes, then its manifest's chain,
    engine and layout (before any payload byte is read), then each chunk's keyed tag."""

    def __init__(self, signing_key: bytes, engine: BlockEngine, block: Block, layers: Sequence[BlockLayer] | None) -> None:
        self.key, self.engine, self.block, self.layers = signing_key, engine, block, layers

    def manifest(self, raw: bytes, store: StateStore) -> Accepted:
        check_manifest_bytes(raw, self.key, allow_unsigned=store.allow_unsigned, where=store.url)
        manifest = parse_block_manifest(raw)
        block = self.block
        if manifest.key != block.key:
            raise IntegrityError(f"block {block.key[:12]} holds the manifest of block {manifest.key[:12]}")
        if manifest.engine != self.engine.digest:
            changed = sorted(k for k in set(manifest.engine_settings) | set(self.engine.settings)
                             if manifest.engine_settings.get(k) != self.engine.settings.get(k))
            raise ForeignStateError(f"block {block.key[:12]} was written by another engine (differs in: "
                                    f"{', '.join(changed) or 'its digest'})")
        if (manifest.parent_key, manifest.start, tuple(manifest.token_ids)) != (block.parent_key, block.start, block.token_ids):
            raise ForeignStateError(f"block {block.key[:12]} holds other tokens or another chain")
        if self.layers is not None and list(manifest.layers) != list(self.layers):
            raise ForeignStateError(f"block {block.key[:12]} has another layout than this engine's cache")
        return Accepted(manifest, chunking_of(manifest, self.key))

    def payload(self, manifest: BlockManifest, payload: Any) -> list[torch.Tensor]:
        plain = open_payload(payload, chunking_of(manifest, self.key))
        if plain is None:
            raise IntegrityError(f"block {self.block.key[:12]}: a chunk does not match its tag")
        return block_tensors(plain, manifest)


class BlockStore:
    """Blocks of one engine and one tenant in `store` (any kvrag store: memory, disk, Redis, Redis
    Cluster, tiers). `signing_key` is resolved as kvrag resolves it (argument, `KVRAG_SIGNING_KEY`,
    key file, the user's key); a `namespace` uses the tenant's derived key."""

    def __init__(self, store: StateStore, engine: BlockEngine, signing_key: bytes | str | None = None,
                 namespace: str = "", deadline_s: float | None = None) -> None:
        self.store, self.engine, self.deadline_s = store, engine, deadline_s
        self._key, self.namespace = key_for(signing_key, namespace)
        self._scope = key_scope(self._key, engine.digest, BLOCK_FORMAT, self.namespace)
        self.stats = BlockStats()
        self._lock = threading.Lock()

    def chain(self, token_ids: Sequence[int], block_size: int) -> list[Block]:
        """The full blocks of `token_ids`, each keyed after the one before it."""
        blocks: list[Block] = []
        parent: str | None = None
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            tokens = tuple(int(t) for t in token_ids[start : start + block_size])
            key = state_key(self._scope, parent, list(tokens))
            blocks.append(Block(key, parent, start, tokens))
            parent = key
        return blocks

    def deadline(self) -> Deadline | None:
        """A budget of `deadline_s` for the store reads of one request (None: unbounded)."""
        return None if self.deadline_s is None else Deadline(self.deadline_s)

    def held(self, blocks: Sequence[Block], deadline: Deadline | None = None) -> int:
        """How many of `blocks`, from the first, the store holds whole (nothing is checked yet),
        within `deadline` (a new one of `deadline_s` if None)."""
        return self.store.holds_run([block.key for block in blocks], deadline or self.deadline())

    def save(self, block: Block, tensors: Sequence[torch.Tensor]) -> None:
        """Store one block's layer tensors (in layer order), signed and sealed."""
        payload, layers = block_payload(tensors)
        stored, seal = seal_payload(payload, self._key, block.key, self.store.chunk_bytes)
        manifest = BlockManifest(
            key=block.key, parent_key=block.parent_key, start=block.start, token_ids=list(block.token_ids),
            engine=self.engine.digest, engine_settings=dict(self.engine.settings), layers=layers,
            payload_bytes=len(payload), payload_chunk_bytes=self.store.chunk_bytes,
            payload_chunks=chunk_digests(payload, self.store.chunk_bytes), payload_seal=seal,
        )
        self.store.put(block.key, sign_manifest_bytes(manifest.to_json_bytes(), self._key), stored)
        with self._lock:
            self.stats.saved += 1

    def load(self, block: Block, layers: Sequence[BlockLayer] | None = None, deadline: Deadline | None = None) -> LoadedBlock:
        """The block's checked tensors, or the `StateError` that says why not (counted by reason).
        `layers`: the layout the caller's cache needs; a block of another layout is foreign.
        `deadline`: shared by the reads of one request (a new one of `deadline_s` if None)."""
        try:
            found = self.store.fetch(block.key, _Acceptance(self._key, self.engine, block, layers),
                                     deadline or self.deadline())
        except StateError as e:
            with self._lock:
                self.stats.refused[e.reason] += 1
            raise
        with self._lock:
            self.stats.loaded[found.tier] += 1
        return LoadedBlock(found.value, found.tier)

    def load_into(self, block: Block, targets: Sequence[torch.Tensor], layers: Sequence[BlockLayer] | None = None,
                  deadline: Deadline | None = None) -> str:
        """Load `block` into `targets` (see `load_run`): the tier that served it, or the
        `StateError` that says why not."""
        run = self.load_run([block], [targets], layers, deadline)
        if run.error is not None:
            raise run.error
        return next(iter(run.tiers))

    def load_run(self, blocks: Sequence[Block], targets: Sequence[Sequence[torch.Tensor]],
                 layers: Sequence[BlockLayer] | None = None, deadline: Deadline | None = None) -> LoadedRun:
        """Load `blocks` into `targets` (per block, the caller's tensors, one per layer, in order),
        in order, until one fails: how many landed, from which tiers, and the `StateError` that
        stopped the run (counted by reason). What the targets of the failed block and those after
        it hold is undefined: compute them again. From a store that receives into the caller's
        memory (Redis over kvrag's direct wire), the run's payloads are received in place and
        checked there; from any other, each block is read and checked first, then copied. All
        within one `deadline`; nothing writes into the targets once this returns."""
        deadline = deadline or self.deadline()
        run = LoadedRun()
        receive = getattr(self.store, "receive_run", None)
        views = [_byte_views(t) if receive is not None else None for t in targets]
        at = 0
        while at < len(blocks) and run.error is None:
            inplace = 0
            while at + inplace < len(blocks) and views[at + inplace] is not None:
                inplace += 1
            if inplace:
                reads = [Receive(b.key, _Acceptance(self._key, self.engine, b, layers), v)
                         for b, v in zip(blocks[at : at + inplace], views[at : at + inplace])]
                landed, error = receive(reads, deadline)
                if landed:
                    with self._lock:
                        self.stats.loaded[self.store.url] += landed
                    run.tiers[self.store.url] += landed
                at += landed
                if isinstance(error, StateError):
                    with self._lock:
                        self.stats.refused[error.reason] += 1
                    run.error = error
                if error is None or run.error is not None:
                    continue
                # not receivable in place (a sealed block, a moved cluster slot): this one is read whole
            try:
                run.tiers[self._load_copy(blocks[at], targets[at], layers, deadline)] += 1
                at += 1
            except StateError as e:
                run.error = e
        run.landed = at
        return run

    def _load_copy(self, block: Block, targets: Sequence[torch.Tensor], layers: Sequence[BlockLayer] | None,
                   deadline: Deadline | None) -> str:
        loaded = self.load(block, layers, deadline)
        if len(loaded.tensors) != len(targets):
            raise ValueError(f"{len(targets)} targets for a block of {len(loaded.tensors)} layers")
        for target, tensor in zip(targets, loaded.tensors):
            target.copy_(tensor)
        return loaded.tier

    def close(self) -> None:
        self.store.close()


def _byte_views(tensors: Sequence[torch.Tensor]) -> list[memoryview] | None:
    """Each tensor's bytes as a writable view (None unless every one is a contiguous CPU tensor)."""
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return None
    return [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors]
