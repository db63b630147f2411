"""The embedded default tier: one file per state, written atomically, read into memory.

A state file is `KVRAGST1`, the manifest's length (8 bytes, little-endian), the manifest, zero
padding to a 4 KiB boundary, then the payload. One file and one rename per write means a reader
sees the old state, the new one, or nothing, never a manifest beside another write's payload.

Reads open regular files only (never blocking on a FIFO or a device) and copy the payload into
process memory with one `readinto`: a file truncated or rewritten in place while being read is a
short read (an integrity miss), never the SIGBUS a memory mapping would raise.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from kvrag.artifacts.digests import read_checked, stored_form
from kvrag.errors import IntegrityError, StoreError
from kvrag.stores.base import BlobStore, ManifestAcceptance, StateStore, StoredState, check_blob_name, check_key

__all__ = ["DiskStore"]

T = TypeVar("T")

MAGIC = b"KVRAGST1"
SUFFIX = ".kvstate"
_ALIGN = 4096
_MAX_MANIFEST = 64 << 20
_MAX_BLOB = 64 << 20
_KEY_NAME = re.compile(r"[0-9a-f]{64}")

log = logging.getLogger("kvrag.stores")


class DiskStore(StateStore, BlobStore):
    """States under `root/states/<key[:2]>/<key>.kvstate`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()
        self.url = f"disk://{self.root}"

    def _path(self, key: str) -> Path:
        check_key(key)
        return self.root / "states" / key[:2] / f"{key}{SUFFIX}"

    def _manifest_length(self, key: str, head: bytes, size: int) -> int:
        if size < 16 or len(head) < 16:
            raise IntegrityError(f"state file {key[:12]} is truncated")
        if head[:8] != MAGIC:
            raise IntegrityError(f"state file {key[:12]} is not a kvrag state")
        (length,) = struct.unpack("<Q", head[8:16])
        if length > _MAX_MANIFEST or _payload_offset(length) > size:
            raise IntegrityError(f"state file {key[:12]} claims a {length}-byte manifest; refusing it")
        return length

    def _open(self, key: str) -> tuple[Any, int] | None:
        """An open regular file and its size, or None if there is none (anything else: integrity)."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {key[:12]} from {self.url}: {e}") from e
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise IntegrityError(f"{key[:12]} in {self.url} is not a regular file; it is never read")
        return os.fdopen(fd, "rb", buffering=0), info.st_size

    def _with_file(self, key: str, read: Callable[[Any, int], T]) -> T | None:
        """`read(file, size)` on the state's file (None if there is none); I/O errors are `StoreError`s."""
        opened = self._open(key)
        if opened is None:
            return None
        f, size = opened
        try:
            with f:
                return read(f, size)
        except OSError as e:
            raise StoreError(f"cannot read {key[:12]} from {self.url}: {e}") from e

    def _head(self, key: str, f: Any, size: int) -> tuple[int, bytes]:
        """The manifest's length and bytes, read from the start of an open state file."""
        length = self._manifest_length(key, f.read(16), size)
        manifest = f.read(length)
        if len(manifest) != length:
            raise IntegrityError(f"state file {key[:12]} was truncated while read")
        return length, manifest

    def read(self, key: str, accept: ManifestAcceptance | None = None) -> StoredState | None:
        """The manifest, accepted, then the payload of the same file (one open, one `readinto`)."""

        def read(f: Any, size: int) -> StoredState:
            length, manifest = self._head(key, f, size)
            accepted = accept(manifest) if accept else None
            offset = _payload_offset(length)
            f.seek(offset)
            chunking = accepted.chunking if accepted is not None else None
            if chunking is not None and chunking.size == size - offset:
                # Each chunk is accepted as the signed manifest says while the next one is read.
                payload = read_checked(f.readinto, chunking)
                if payload is None:
                    raise IntegrityError(f"state file {key[:12]}: a chunk does not pass its {chunking.chunk_opener.name} check "
                                         "or the file changed while read")
                return StoredState(manifest, payload, accepted)
            payload = bytearray(size - offset)
            got = f.readinto(payload)
            if got != len(payload):
                raise IntegrityError(f"state file {key[:12]} changed size while read ({got} of {len(payload)} bytes)")
            return StoredState(manifest, payload, accepted)

        return self._with_file(key, read)

    def read_manifest(self, key: str) -> bytes | None:
        return self._with_file(key, lambda f, size: self._head(key, f, size)[1])

    def _holds(self, key: str) -> bool:
        def whole(f: Any, size: int) -> bool:
            try:
                length, manifest = self._head(key, f, size)
                declared = int(json.loads(manifest).get("payload_bytes", -1))
            except (IntegrityError, ValueError, AttributeError, TypeError, RecursionError):
                return False
            return size == _payload_offset(length) + declared

        return bool(self._with_file(key, whole))

    def put(self, key: str, manifest: bytes, payload: Any) -> None:
        path = self._path(key)
        header = MAGIC + struct.pack("<Q", len(manifest)) + manifest
        padding = b"\0" * (_payload_offset(len(manifest)) - len(header))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(header)
                    f.write(padding)
                    f.write(stored_form(payload))  # a sealed state promoted here: its stored bytes
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            raise StoreError(f"cannot write {key[:12]} to {self.url}: {e}") from e

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:  # a directory planted under a state's name, say: never removed as a state
            raise StoreError(f"cannot delete {key[:12]} from {self.url}: {e}") from e

    def keys(self) -> Iterator[str]:
        """The keys of the regular state files; anything else under a state's name is skipped,
        with one line in the log."""
        base = self.root / "states"
        if not base.is_dir():
            return iter(())
        return (p.name.removesuffix(SUFFIX) for p in sorted(base.glob(f"??/*{SUFFIX}")) if self._is_state_file(p))

    def _is_state_file(self, path: Path) -> bool:
        try:
            regular = stat.S_ISREG(path.lstat().st_mode)
        except OSError:
            return False
        key = path.name.removesuffix(SUFFIX)
        if regular and _KEY_NAME.fullmatch(key) and key[:2] == path.parent.name:
            return True
        log.warning("skipped %s in %s: not a state file", path.name[:80], self.url)
        return False

    def _blob_path(self, name: str) -> Path:
        namespace, digest = check_blob_name(name).split("/")
        return self.root / "blobs" / namespace / digest

    def get_blob(self, name: str) -> bytes | None:
        path = self._blob_path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {name} from {self.url}: {e}") from e
        with os.fdopen(fd, "rb", buffering=0) as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None  # a FIFO or a device is never read
            try:
                data = f.read(_MAX_BLOB + 64)
            except OSError as e:
                raise StoreError(f"cannot read {name} from {self.url}: {e}") from e
        expires, _, body = data.partition(b"\n")
        try:
            if len(data) > _MAX_BLOB or (expires and float(expires) < time.time()):
                return None
        except ValueError:
            return None  # a damaged expiry line: the blob is unreadable, a miss
        return body

    def put_blob(self, name: str, data: bytes, *, ttl: int | None = None) -> None:
        path = self._blob_path(name)
        expires = f"{time.time() + ttl:.3f}".encode() if ttl else b""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            with os.fdopen(fd, "wb") as f:
                f.write(expires + b"\n" + data)
            os.replace(tmp, path)
        except OSError as e:
            raise StoreError(f"cannot write {name} to {self.url}: {e}") from e

    def delete_blob(self, name: str) -> None:
        self._blob_path(name).unlink(missing_ok=True)

    def blob_names(self, namespace: str) -> Iterator[str]:
        folder = self.root / "blobs" / namespace
        if not folder.is_dir():
            return iter(())
        return (f"{namespace}/{p.name}" for p in sorted(folder.iterdir()) if not p.name.startswith(".") and self.get_blob(f"{namespace}/{p.name}") is not None)

    def stray_files(self, grace_s: float = 0.0) -> list[Path]:
        """Temporary files left by writes that were interrupted (what `kvrag gc` removes); files
        younger than `grace_s` may belong to a write in progress and are left alone."""
        base = self.root / "states"
        now = time.time()
        found = []
        for path in sorted(base.glob("??/.*")) if base.is_dir() else []:
            try:
                if now - path.lstat().st_mtime >= grace_s:
                    found.append(path)
            except FileNotFoundError:
                continue
        return found


def _payload_offset(manifest_length: int) -> int:
    return -(-(16 + manifest_length) // _ALIGN) * _ALIGN
