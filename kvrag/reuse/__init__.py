"""Reuse beyond one own-position graft: memo (recurring queries), prefix records (any-boundary
reuse), the exact levers, deposits off the answer's path, and the approximate, gated features (moved states, blend, gate)."""

from kvrag.reuse.chapters import Chapters
from kvrag.reuse.deposit_queue import DepositQueue, DepositStats
from kvrag.reuse.gate import BlendGate, GateResult
from kvrag.reuse.levers import ChainWarmer, CorpusChain, stored_prefix_first
from kvrag.reuse.lexical import IndexedDoc, LexicalIndex
from kvrag.reuse.memo import Memo, MemoEntry, Provenance, canonical_query

__all__ = ["Memo", "MemoEntry", "Provenance", "canonical_query", "BlendGate", "GateResult", "ChainWarmer", "CorpusChain",
           "stored_prefix_first", "IndexedDoc", "LexicalIndex", "DepositQueue", "DepositStats", "Chapters"]
