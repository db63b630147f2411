"""`KVRagConnector`: vLLM's KV connector over kvrag's stores.

Scheduler side: for a new request, the longest run of the prompt's full blocks, after those in
vLLM's own prefix cache, that the store holds is offered to vLLM as computed (loaded before the
forward); the prompt's other full blocks are saved once the forward that completes them ran.
Worker side: a load reads each block through kvrag's checks (signature, chain, engine
fingerprint, layout, keyed chunk tags) into its place in the paged cache (from Redis, received
there and checked where it lies; from other stores, checked, then copied); a block that fails
(missing, damaged, unsigned, foreign, the store down or past its deadline) and every block after
it are reported to vLLM as load errors, so vLLM computes them (`kv_load_failure_policy:
"recompute"`, which the connector requires). Every refusal is counted by its reason and logged.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvrag.errors import KVRagError
from kvrag.paged import Block, BlockLayer, BlockStore
from vllm_kvrag.settings import ConnectorSettings, block_engine, namespace_of, shared_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVRagConnector", "KVRagMetadata"]

#: a child of vLLM's logger: its lines come out with vLLM's, in its format and at its level
log = logging.getLogger("vllm.kvrag")


@dataclass
class _Transfer:
    """One request's blocks to load or save this step: (vLLM block id, kvrag block) pairs."""

    request_id: str
    namespace: str
    blocks: list[tuple[int, Block]]


@dataclass
class KVRagMetadata(KVConnectorMetadata):
    """What the scheduler hands the worker for one step."""

    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


@dataclass
class _Plan:
    """The scheduler's view of one request: its prompt's full blocks, which it loads, how far its
    saves went, and its vLLM block ids."""

    namespace: str
    chain: list[Block]
    load_from: int = 0
    load_to: int = 0
    saved_to: int = 0
    block_ids: list[int] = field(default_factory=list)


class KVRagConnector(KVConnectorBase_V1):
    """Load and save vLLM's KV blocks through kvrag's verified stores (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise ValueError('kvrag connector: set kv_transfer_config\'s "kv_load_failure_policy": "recompute", so '
                             "blocks that fail kvrag's checks are computed instead of failing the request")
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise ValueError("kvrag connector: one worker only (tensor and pipeline parallel size 1)")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError("kvrag connector: models with one KV cache group only (no sliding-window or "
                             "hybrid layers)")
        self.settings = ConnectorSettings.from_extra_config(dict(transfer.kv_connector_extra_config or {}))
        if "memory://" in self.settings.store and parallel.distributed_executor_backend != "uni":
            raise ValueError("kvrag connector: a memory:// store lives in one process, and vLLM's worker runs in a "
                             "process of its own; use disk:// or Redis, or run the worker in-process "
                             "(distributed_executor_backend='uni'; on CPU also VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        self.block_size = vllm_config.cache_config.block_size
        self.engine = block_engine(vllm_config)
        self._store = shared_store(self.settings.store)
        self._tenants: dict[str, BlockStore] = {}
        self._lock = threading.Lock()
        # scheduler side
        self._plans: dict[str, _Plan] = {}
        # worker side
        self._caches: list[torch.Tensor] = []
        self._block_dims: list[int] = []
        self._layers: list[BlockLayer] | None = None
        self._failed: set[int] = set()
        # requests whose load failed this step: what the forward computed after it read a bad block
        self._failed_requests: set[str] = set()

    def blocks_of(self, namespace: str) -> BlockStore:
        """The block store of one tenant (made once)."""
        with self._lock:
            if namespace not in self._tenants:
                self._tenants[namespace] = BlockStore(self._store, self.engine, self.settings.signing_key, namespace,
                                                      self.settings.deadline_s)
            return self._tenants[namespace]

    # ---- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        prompt = list(request.prompt_token_ids or [])
        namespace = namespace_of(self.settings.namespace, getattr(request, "cache_salt", None))
        blocks = self.blocks_of(namespace)
        chain = blocks.chain(prompt, self.block_size)
        # the last prompt token is always computed: it gives the first token's logits
        loadable = (len(prompt) - 1) // self.block_size
        local = num_computed_tokens // self.block_size
        held = local + blocks.held(chain[local:loadable])
        self._plans[request.request_id] = _Plan(namespace, chain, local, held, saved_to=held)
        return max(0, held * self.block_size - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        if plan is not None and num_external_tokens == 0:
            plan.load_to = plan.load_from

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVRagMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            plan = self._plans.get(new.req_id)
            if plan is None:
                continue
            plan.block_ids = list(new.block_ids[0])
            if plan.load_to > plan.load_from:
                meta.loads.append(_Transfer(new.req_id, plan.namespace, [
                    (plan.block_ids[i], plan.chain[i]) for i in range(plan.load_from, plan.load_to)]))
            self._plan_saves(meta, new.req_id, plan, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            plan = self._plans.get(req_id)
            if plan is None:
                continue
            new_ids = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:
                plan.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                plan.block_ids.extend(new_ids[0])
            computed = cached.num_computed_tokens[index] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._plan_saves(meta, req_id, plan, computed)
        return meta

    def _plan_saves(self, meta: KVRagMetadata, req_id: str, plan: _Plan, computed: int) -> None:
        """Blocks completed by this step's forward that the store did not hold: saved after it."""
        done = min(len(plan.chain), computed // self.block_size, len(plan.block_ids))
        if done > plan.saved_to:
            meta.saves.append(_Transfer(req_id, plan.namespace, [
                (plan.block_ids[i], plan.chain[i]) for i in range(plan.saved_to, done)]))
            plan.saved_to = done

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """Blocks that failed to load are computed again by vLLM: save them (and what follows) once
        they are, over the stored copies that failed."""
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for plan in self._plans.values():
            failed = [i for i, block_id in enumerate(plan.block_ids) if block_id in invalid]
            if failed:
                plan.saved_to = min(plan.saved_to, failed[0])

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._plans.pop(request.request_id, None)
        return False, None

    # ---- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        self._caches, self._block_dims = [], []
        for name in sorted(kv_caches, key=_layer_order):
            cache = kv_caches[name]
            dims = [d for d, size in enumerate(cache.shape) if size == num_blocks]
            if not dims:
                raise ValueError(f"kvrag connector: no dimension of {num_blocks} blocks in layer {name}'s cache "
                                 f"{tuple(cache.shape)}")
            self._caches.append(cache)
            self._block_dims.append(dims[0])
        self._layers = [BlockLayer.of(str(i), view) for i, view in enumerate(self._views(0))]

    def _views(self, block_id: int) -> list[torch.Tensor]:
        return [cache.select(dim, block_id) for cache, dim in zip(self._caches, self._block_dims)]

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRagMetadata)
        for transfer in meta.loads:
            self._load(transfer)

    def _load(self, transfer: _Transfer) -> None:
        """The request's blocks, in order, into their places in the paged cache; the first that
        fails ends the load (it and the rest are load errors, computed by vLLM)."""
        blocks = self.blocks_of(transfer.namespace)
        try:
            run = blocks.load_run([block for _, block in transfer.blocks],
                                  [self._views(block_id) for block_id, _ in transfer.blocks], self._layers)
            landed, tiers, error = run.landed, run.tiers, run.error
        except KVRagError as e:  # not a verdict on a block (a store that cannot be opened): none loads
            landed, tiers, error = 0, Counter(), e
        if error is not None:
            self._failed.update(block_id for block_id, _ in transfer.blocks[landed:])
            self._failed_requests.add(transfer.request_id)
            log.warning("kvrag: request %s: loaded %d of %d blocks (%s); block %s refused (%s): %s; vLLM computes "
                        "the rest", transfer.request_id, landed, len(transfer.blocks), _tiers(tiers),
                        transfer.blocks[landed][1].key[:12], getattr(error, "reason", "unavailable"), error)
            return
        log.info("kvrag: request %s: loaded %d blocks (%s)", transfer.request_id, len(transfer.blocks), _tiers(tiers))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # blocks are saved whole, after the forward (`wait_for_save`)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRagMetadata)
        failed, self._failed_requests = self._failed_requests, set()
        for transfer in meta.saves:
            if transfer.request_id in failed:  # computed after a block that failed to load: never stored
                continue
            blocks = self.blocks_of(transfer.namespace)
            try:
                for block_id, block in transfer.blocks:
                    blocks.save(block, self._views(block_id))
            except KVRagError as e:  # a store that cannot take it: a later request computes it again
                log.warning("kvrag: request %s: could not save its blocks: %s", transfer.request_id, e)
                continue
            log.info("kvrag: request %s: saved %d blocks", transfer.request_id, len(transfer.blocks))

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        for namespace, blocks in self._tenants.items():
            stats = blocks.stats
            if stats.saved or stats.loaded or stats.refused:
                    log.info("kvrag: namespace %r: saved %d blocks, loaded %s, refused %s", namespace, stats.saved,
                         dict(stats.loaded), dict(stats.refused))


def _tiers(tiers: Counter[str]) -> str:
    return ", ".join(f"{count} from {tier}" for tier, count in tiers.items()) or "none"


def _layer_order(name: str) -> tuple[int, str]:
    digits = [int(part) for part in name.split(".") if part.isdigit()]
    return (digits[0] if digits else -1, name)

