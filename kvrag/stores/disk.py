"""The embedded default tier: one file per state, written atomically, read through mmap.

A state file is `KVRAGST1`, the manifest's length (8 bytes, little-endian), the manifest, zero
padding to a 4 KiB boundary, then the payload. One file and one rename per write means a reader
sees the old state, the new one, or nothing, never a manifest beside another write's payload; and
a page-aligned payload maps straight into tensors without a copy.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from kvrag.errors import IntegrityError, StoreError
from kvrag.stores.base import BlobStore, StateStore, StoredState, check_blob_name, check_key

__all__ = ["DiskStore"]

MAGIC = b"KVRAGST1"
SUFFIX = ".kvstate"
_ALIGN = 4096
_MAX_MANIFEST = 64 << 20


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

    def read(self, key: str, check: Callable[[bytes], Any] | None = None) -> StoredState | None:
        """One mapping of the file: the manifest and the payload come from the same write."""
        try:
            with self._path(key).open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 16:
                    raise IntegrityError(f"state file {key[:12]} is truncated")
                # A private copy-on-write mapping: tensors view the page cache without a copy, and
                # nothing written through them could ever reach the file.
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {key[:12]} from {self.url}: {e}") from e
        length = self._manifest_length(key, data[:16], len(data))
        manifest = bytes(data[16 : 16 + length])
        checked = check(manifest) if check else None
        return StoredState(manifest, memoryview(data)[_payload_offset(length) :], checked)

    def read_manifest(self, key: str) -> bytes | None:
        try:
            with self._path(key).open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                length = self._manifest_length(key, f.read(16), size)
                return f.read(length)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {key[:12]} from {self.url}: {e}") from e

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
                    f.write(payload)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            raise StoreError(f"cannot write {key[:12]} to {self.url}: {e}") from e

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def keys(self) -> Iterator[str]:
        base = self.root / "states"
        if not base.is_dir():
            return iter(())
        return (p.name.removesuffix(SUFFIX) for p in sorted(base.glob(f"??/*{SUFFIX}")))

    def _blob_path(self, name: str) -> Path:
        namespace, digest = check_blob_name(name).split("/")
        return self.root / "blobs" / namespace / digest

    def get_blob(self, name: str) -> bytes | None:
        path = self._blob_path(name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {name} from {self.url}: {e}") from e
        expires, _, body = data.partition(b"\n")
        if expires and float(expires) < time.time():
            return None
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

    def stray_files(self) -> list[Path]:
        """Temporary files left by writes that were interrupted (what `kvrag gc` removes)."""
        base = self.root / "states"
        return sorted(base.glob("??/.*")) if base.is_dir() else []


def _payload_offset(manifest_length: int) -> int:
    return -(-(16 + manifest_length) // _ALIGN) * _ALIGN
