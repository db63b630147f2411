"""Paged engines' KV blocks (vLLM's) as kvrag artifacts: what a block holds and its layout
(`blocks`), and a tenant's chained, signed, checked blocks in any kvrag store (`store`)."""

from kvrag.paged.blocks import BlockEngine, BlockLayer, BlockManifest
from kvrag.paged.store import Block, BlockStats, BlockStore, LoadedBlock, LoadedRun

__all__ = ["BlockEngine", "BlockLayer", "BlockManifest", "Block", "BlockStats", "BlockStore", "LoadedBlock", "LoadedRun"]
