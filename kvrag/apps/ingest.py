"""Ingest a corpus: every document deposited as its own verified state, resumably and in shards.

A corpus is a folder of text files (`*.txt`, `*.md`, each document's id its path in the folder) or
a JSONL file of `{"id", "text"}` lines (what `kvrag ab --docs` reads). What some tier already holds
is skipped, so an ingest that stopped halfway resumes where it stopped. `Shard(i, n)` takes the
documents whose id hashes to `i` of `n`, so `n` processes or machines can fill one store (a Redis
Cluster) together without depositing a document twice.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from pydantic import BaseModel, Field

from kvrag.apps.ab.results import load_jsonl
from kvrag.engine.engine import KVEngine
from kvrag.errors import InputError, KVRagError

__all__ = ["CorpusDocument", "Shard", "IngestSummary", "read_corpus", "ingest"]

#: the files of a corpus folder that are documents
TEXT_SUFFIXES = (".txt", ".md")


@dataclass(frozen=True)
class CorpusDocument:
    id: str
    text: str


@dataclass(frozen=True)
class Shard:
    """The documents whose id hashes to `index` of `count` (`Shard(0, 1)`: all of them)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise InputError(f"shard {self.index}/{self.count}: the index must be from 0 to {self.count - 1}")

    @classmethod
    def parse(cls, text: str) -> "Shard":
        """`i/N`, e.g. `0/4` for the first of four shards."""
        index, slash, count = text.partition("/")
        if not slash or not index.strip().isdigit() or not count.strip().isdigit() or int(count) < 1:
            raise InputError(f"--shard takes i/N (e.g. 0/4, the first of four), not {text!r}")
        return cls(int(index), int(count))

    def takes(self, document_id: str) -> bool:
        digest = hashlib.sha256(document_id.encode()).digest()
        return int.from_bytes(digest[:8], "big") % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


class IngestFailure(BaseModel):
    id: str
    error: str


class IngestSummary(BaseModel):
    """What an ingest did to the documents of its shard."""

    shard: str
    documents: int
    deposited: int = 0
    #: held by some tier already (a resumed or repeated ingest)
    skipped: int = 0
    failed: list[IngestFailure] = Field(default_factory=list)
    #: tokens and stored payload bytes of the states deposited now
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0


def read_corpus(path: str | Path) -> list[CorpusDocument]:
    """The documents of a corpus folder or JSONL file, in a stable order; unreadable input is an `InputError`."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        documents = [CorpusDocument(str(p.relative_to(path)), _read(p)) for p in files]
    elif path.is_file():
        documents = list(_jsonl(path))
    else:
        raise InputError(f"{path} is neither a folder of text files nor a JSONL file")
    if not documents:
        raise InputError(f"{path} holds no documents ({', '.join(TEXT_SUFFIXES)} files, or JSONL lines)")
    seen: set[str] = set()
    for document in documents:
        if document.id in seen:
            raise InputError(f"{path}: the id {document.id!r} names two documents")
        seen.add(document.id)
    return documents


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it first") from e
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror or e}") from e


def _jsonl(path: Path) -> Iterator[CorpusDocument]:
    for index, row in enumerate(load_jsonl(path, ["id", "text"]), 1):
        if not isinstance(row["id"], (str, int)) or not isinstance(row["text"], str):
            raise InputError(f'{path}: document {index} is not a {{"id", "text"}} object with a string text')
        yield CorpusDocument(str(row["id"]), row["text"])


def ingest(engine: KVEngine, documents: Iterable[CorpusDocument], *, shard: Shard = Shard(),
           progress: Callable[[CorpusDocument, int], None] | None = None) -> IngestSummary:
    """Deposit each document of `shard` as its own state, skipping those some tier holds already.
    A document that cannot be deposited (empty, too long, a failed verification or write) is
    listed in `failed` and the ingest goes on. `progress(document, tokens)` follows each one."""
    began = time.perf_counter()
    taken = [d for d in documents if shard.takes(d.id)]
    summary = IngestSummary(shard=str(shard), documents=len(taken))
    for document in taken:
        tokens = 0
        try:
            segment = engine.plan([document.text])[0]
            tokens = len(segment.ids)
            if engine.holds(engine.planner.ref(segment)):
                summary.skipped += 1
            else:
                for deposited in engine.depositor.extend([segment]):
                    summary.tokens += deposited.manifest.token_count
                    summary.bytes += deposited.manifest.payload_bytes
                summary.deposited += 1
        except KVRagError as e:
            summary.failed.append(IngestFailure(id=document.id, error=" ".join(str(e).split())[:500]))
        if progress is not None:
            progress(document, tokens)
    summary.seconds = round(time.perf_counter() - began, 3)
    return summary
