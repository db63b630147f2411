"""The embedded default tier: one folder per state, written atomically, read through mmap."""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from kvrag.errors import StoreError
from kvrag.stores.base import StateStore, check_key

__all__ = ["DiskStore"]

MANIFEST = "manifest.json"
PAYLOAD = "payload.safetensors"


class DiskStore(StateStore):
    """States under `root/states/<key[:2]>/<key>/`: payload first, manifest last, each via rename."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()
        self.url = f"disk://{self.root}"

    def _dir(self, key: str) -> Path:
        check_key(key)
        return self.root / "states" / key[:2] / key

    def get_manifest(self, key: str) -> bytes | None:
        try:
            return (self._dir(key) / MANIFEST).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {key[:12]} from {self.url}: {e}") from e

    def get_payload(self, key: str) -> mmap.mmap | bytes | None:
        path = self._dir(key) / PAYLOAD
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    return b""
                # A private copy-on-write mapping: tensors view the page cache without a copy, and
                # nothing written through them could ever reach the file.
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {key[:12]} from {self.url}: {e}") from e

    def put(self, key: str, manifest: bytes, payload: bytes) -> None:
        folder = self._dir(key)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._write_atomic(folder / PAYLOAD, payload)
            self._write_atomic(folder / MANIFEST, manifest)
        except OSError as e:
            raise StoreError(f"cannot write {key[:12]} to {self.url}: {e}") from e

    @staticmethod
    def _write_atomic(path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def delete(self, key: str) -> None:
        folder = self._dir(key)
        (folder / MANIFEST).unlink(missing_ok=True)  # manifest first: readers see a miss, never a half
        shutil.rmtree(folder, ignore_errors=True)

    def keys(self) -> Iterator[str]:
        base = self.root / "states"
        if not base.is_dir():
            return iter(())
        return (p.parent.name for p in sorted(base.glob(f"??/*/{MANIFEST}")))
