"""Framing for remote tiers: a payload split into fixed-size frames, each with its own SHA-256.

A reader checks each frame as the signed manifest says (its keyed tag, its AEAD tag, or for older
states its SHA-256; see `kvrag.artifacts.digests.ChunkOpener`) on the hashing threads while the
next one is on the wire; the frame table's own digests only say which frames belong to it.

The frame table (JSON) holds the state's manifest and the frames' digests. It is written after
every frame, so a reader that finds a frame table finds frames that were complete when it was written;
a frame that has since been evicted, truncated or altered makes the whole state a miss. Frames are
named by the payload's digest, so two writers of the same key never mix their frames.
"""

from __future__ import annotations

import hashlib
import re
from concurrent.futures import Future
from typing import Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvrag.artifacts.digests import CHUNK_BYTES, CheckedBuffer, PayloadChunking, chunk_digests, hash_pool
from kvrag.errors import IntegrityError

__all__ = ["FrameTable", "DEFAULT_FRAME_BYTES", "MAX_STATE_BYTES", "MAX_FRAMES", "Assembler", "make_frame_table", "parse_frame_table", "split", "assemble"]

DEFAULT_FRAME_BYTES = CHUNK_BYTES  # the manifest's chunk size: frame checks then stand for the payload check
MAX_STATE_BYTES = 1 << 36  # 64 GiB: anything larger is a forged or corrupt frame table
#: the most frames a frame table may list (a 512 MiB state in 8 KiB frames; 8 GiB in the default 8 MiB
#: chunks use 1,024): a forged frame table listing more is refused before any frame is asked for
MAX_FRAMES = 1 << 16
_HEX64 = r"^[0-9a-f]{64}$"
_HEX_RUN = re.compile(r"[0-9a-f]*")


class FrameTable(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["kvrag.frames/1"] = "kvrag.frames/1"
    manifest: str = Field(max_length=64 << 20)
    payload_sha256: str = Field(pattern=_HEX64)
    payload_bytes: int = Field(ge=0, le=MAX_STATE_BYTES)
    frame_bytes: int = Field(ge=1, le=1 << 30)
    frames: list[str] = Field(max_length=MAX_FRAMES)

    @model_validator(mode="after")
    def _counts_agree(self) -> "FrameTable":
        expected = -(-self.payload_bytes // self.frame_bytes)
        if len(self.frames) != expected:
            raise ValueError(f"{len(self.frames)} frames cannot hold {self.payload_bytes} bytes in {self.frame_bytes}-byte frames")
        # one C-level pass, not a Python loop per character: a forged frame table may list a million frames
        if any(len(digest) != 64 for digest in self.frames) or not _HEX_RUN.fullmatch("".join(self.frames)):
            raise ValueError("frame digests must be 64 lowercase hex characters")
        return self

    @property
    def payload_id(self) -> str:
        return self.payload_sha256[:16]

    def frame_length(self, index: int) -> int:
        return min(self.frame_bytes, self.payload_bytes - index * self.frame_bytes)

    def check_lists(self, chunking: PayloadChunking, key: str) -> None:
        """Refuse (`IntegrityError`) a frame table that lists anything but exactly the signed
        manifest's chunks: checked before a frame is asked for or a byte allocated."""
        if (self.payload_bytes, self.frame_bytes, list(self.frames)) != (
            chunking.size, chunking.chunk_bytes, list(chunking.chunks)
        ):
            raise IntegrityError(f"state {key[:12]}: its frame table does not list the manifest's chunks")


def make_frame_table(manifest: bytes, payload: bytes | memoryview, frame_bytes: int = DEFAULT_FRAME_BYTES,
                     digests: Sequence[str] | None = None) -> tuple[FrameTable, list[memoryview]]:
    """The frame table of `payload` cut in `frame_bytes` frames, and the frames. `digests`: the
    frames' SHA-256 digests as the signed manifest lists them (its chunks are the frames), not
    computed again: a reader checks each frame against the manifest's list anyway."""
    frames = split(payload, frame_bytes)
    frame_table = FrameTable(
        manifest=manifest.decode(),
        payload_sha256=hashlib.sha256(payload).hexdigest(),
        payload_bytes=len(payload),
        frame_bytes=frame_bytes,
        frames=list(digests) if digests is not None and len(digests) == len(frames) else chunk_digests(payload, frame_bytes),
    )
    return frame_table, frames


def parse_frame_table(raw: bytes) -> FrameTable:
    """Parse a frame table; sizes and counts are checked before anything is allocated."""
    try:
        return FrameTable.model_validate_json(raw)
    except (ValidationError, ValueError, UnicodeDecodeError) as e:
        raise IntegrityError(f"frame table is malformed: {str(e).splitlines()[0]}") from e


def split(payload: bytes | memoryview, frame_bytes: int) -> list[memoryview]:
    view = memoryview(payload).cast("B")
    return [view[i : i + frame_bytes] for i in range(0, len(view), frame_bytes)]


class Assembler:
    """Frames checked (and, for a sealed payload, opened) into one buffer as they arrive, on the
    hashing threads, by `chunking` (default: the frame table's own SHA-256 digests, for tools' raw reads).

    Feed batches in order with `add`, or receive frames into `slot(i)` and call `received(i)`;
    `result()` waits for the checks and returns the plaintext buffer, marked with what checked it,
    or raises `IntegrityError`.
    """

    def __init__(self, frame_table: FrameTable, max_bytes: int = MAX_STATE_BYTES, chunking: PayloadChunking | None = None) -> None:
        if frame_table.payload_bytes > max_bytes:
            raise IntegrityError(f"frame table claims {frame_table.payload_bytes} bytes, over this store's limit of {max_bytes}")
        self.frame_table = frame_table
        self.chunking = chunking or PayloadChunking(frame_table.payload_bytes, frame_table.frame_bytes, tuple(frame_table.frames))
        if (self.chunking.size, self.chunking.chunk_bytes) != (frame_table.payload_bytes, frame_table.frame_bytes):
            raise IntegrityError("the frame table's sizes are not the manifest's")
        self.opener = self.chunking.chunk_opener
        if self.chunking.plaintext_bytes > max_bytes:
            raise IntegrityError(f"the payload claims {self.chunking.plaintext_bytes} bytes, over this store's limit of {max_bytes}")
        self.buffer = CheckedBuffer(frame_table.payload_bytes)
        self.plain = self.buffer if self.opener.in_place else CheckedBuffer(self.chunking.plaintext_bytes)
        self._view = self.buffer.view()
        self._next = 0
        self._checks: list[Future[None]] = []

    def add(self, frames: Sequence[bytes | None]) -> bool:
        """Queue a batch; False if a frame is missing (the state is a miss)."""
        for frame in frames:
            index = self._next
            if frame is None:
                return False
            if index >= len(self.frame_table.frames) or len(frame) != self.frame_table.frame_length(index):
                raise IntegrityError(f"frame {index} is {len(frame)} bytes, expected {self.frame_table.frame_length(min(index, len(self.frame_table.frames) - 1))}")
            self.slot(index)[:] = frame
            self.received(index)
            self._next += 1
        return True

    def placed(self, count: int) -> None:
        self._next = count

    def slot(self, index: int) -> memoryview:
        """Where frame `index` goes in the buffer: a reader that receives it there directly calls
        `received(index)` next, and the frame is checked in place."""
        offset = index * self.frame_table.frame_bytes
        return self._view[offset : offset + self.frame_table.frame_length(index)]

    def _plain_slot(self, index: int) -> memoryview:
        return self.slot(index) if self.plain is self.buffer else self.chunking.plain_slot(self.plain, index)

    def received(self, index: int) -> None:
        """Frame `index` is in its slot: check it on the hashing threads."""
        self._checks.append(hash_pool().submit(self._check, index))

    def _check(self, index: int) -> None:
        if not self.opener.open(index, self.slot(index), self._plain_slot(index)):
            raise IntegrityError(f"frame {index} does not pass its {self.opener.name} check")

    def result(self) -> CheckedBuffer:
        for check in self._checks:
            check.result()
        if self._next != len(self.frame_table.frames):
            raise IntegrityError(f"{self._next} frames arrived, the frame table lists {len(self.frame_table.frames)}")
        self.plain.checked_by = self.opener.identity
        if self.plain is not self.buffer:
            self.plain.sealed = self.buffer
        return self.plain


def assemble(frame_table: FrameTable, frames: Sequence[bytes | None]) -> CheckedBuffer | None:
    """One buffer from all the frames, each checked; `None` if any frame is missing."""
    if len(frames) != len(frame_table.frames) or any(f is None for f in frames):
        return None
    assembler = Assembler(frame_table)
    assembler.add(frames)
    return assembler.result()
