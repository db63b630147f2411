"""The embedded default tier: one file per state, written atomically, read into memory.

A state file is `KVRAGST1`, the manifest's length (8 bytes, little-endian), the manifest, zero
padding to a 4 KiB boundary, then the payload. One file and one rename per write means a reader
sees the old state, the new one, or nothing, never a manifest beside another write's payload.

Reads open regular files only (never blocking on a FIFO or a device) and copy the payload into
process memory with one `readinto`: a file truncated or rewritten in place while being read is a
short read (an integrity miss), never the SIGBUS a memory mapping would raise.

A capped store (`disk://PATH?max_gib=50`) drops states after each write until its state files fit,
in `kvrag.stores.capacity` order: every read marks its file used (its modification time, which
the kernel never moves on a read, unlike the access time), so every process sharing the folder sees
the others' reads. A dropped file is unlinked: a reader that opened it first still reads it whole,
a later one misses.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import stat
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar
from urllib.parse import parse_qsl, urlencode

from kvrag.artifacts.digests import read_checked, stored_form
from kvrag.errors import IntegrityError, StoreError
from kvrag.stores.base import BlobStore, ManifestAcceptance, StateStore, StoredState, check_blob_name, check_key
from kvrag.stores.capacity import DEFAULT_HALF_LIFE_S, Eviction, Uses, capacity_params

__all__ = ["DiskStore", "StateFile"]

T = TypeVar("T")

MAGIC = b"KVRAGST1"
SUFFIX = ".kvstate"
_ALIGN = 4096
_MAX_MANIFEST = 64 << 20
_MAX_BLOB = 64 << 20
_KEY_NAME = re.compile(r"[0-9a-f]{64}")

log = logging.getLogger("kvrag.stores")


@dataclass(frozen=True)
class StateFile:
    key: str
    path: Path
    size: int
    last_used: float  # seconds since the epoch: its write or, in a capped store, its last read

#: the query parameters its URL takes, besides those every tier takes
PARAMS = ("max_gib", "evict", "half_life_s")


class DiskStore(StateStore, BlobStore):
    """States under `root/states/<key[:2]>/<key>.kvstate`; with `max_bytes`, those files are kept
    within that many bytes (see the module's docstring)."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int | None = None, *, eviction: Eviction = "lru",
                 half_life_s: float = DEFAULT_HALF_LIFE_S) -> None:
        if max_bytes is not None and max_bytes < 1:
            raise StoreError("a disk store's cap must be at least one byte (disk://PATH?max_gib=50)")
        self.root = Path(root).expanduser()
        self.max_bytes = max_bytes
        self.uses = Uses(eviction, half_life_s)
        self.evictions = 0
        query = {} if max_bytes is None else {"max_gib": f"{max_bytes / (1 << 30):g}"}
        if eviction != "lru":
            query["evict"] = eviction
        if half_life_s != DEFAULT_HALF_LIFE_S:
            query["half_life_s"] = f"{half_life_s:g}"
        self.url = f"disk://{self.root}" + (f"?{urlencode(query)}" if query else "")

    @classmethod
    def from_url_rest(cls, rest: str) -> "DiskStore":
        """From what follows `disk://`: a folder, and optionally `?max_gib=N&evict=lru|value&half_life_s=S`."""
        folder, _, query = rest.partition("?")
        params = dict(parse_qsl(query, keep_blank_values=True))
        unknown = set(params) - set(PARAMS)
        if unknown:
            raise StoreError(f"disk:// takes only ?max_gib=N&evict=lru|value&half_life_s=S, not {', '.join(sorted(unknown))}")
        if not folder:
            raise StoreError("disk:// needs a folder, e.g. disk:///var/cache/kvrag or disk://./states")
        max_bytes, eviction, half_life_s = capacity_params(params, size_name="max_gib")
        return cls(Path(folder), max_bytes, eviction=eviction, half_life_s=half_life_s)

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
            self._used(key, f)
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

    def _used(self, key: str, f: Any) -> None:
        """Mark a state read: its modification time for every process, a hit for this one's `value` order."""
        if self.max_bytes is None:
            return
        self.uses.hit(key)
        try:
            os.utime(f.fileno(), ns=(os.fstat(f.fileno()).st_atime_ns, time.time_ns()))
        except OSError:
            pass  # a file this user cannot touch keeps its old time: it only goes sooner

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
        body = stored_form(payload)  # a sealed state promoted here: its stored bytes
        size = len(header) + len(padding) + memoryview(body).nbytes
        if self.max_bytes is not None and size > self.max_bytes:
            self.delete(key)  # larger than the cap: not kept here (the tiers behind may keep it)
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(header)
                    f.write(padding)
                    f.write(body)
                    f.flush()
                    os.fsync(f.fileno())
                if self.max_bytes is not None:
                    self.uses.hit(key)
                    self.evict(self.max_bytes - size, keep=key)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            raise StoreError(f"cannot write {key[:12]} to {self.url}: {e}") from e

    def delete(self, key: str) -> None:
        self.uses.forget(key)
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

    def state_files(self) -> list[StateFile]:
        """Every state file, its size and last use (files that vanish while listed are left out)."""
        base = self.root / "states"
        found = []
        for folder in sorted(base.glob("??")) if base.is_dir() else []:
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for entry in entries:
                key = entry.name.removesuffix(SUFFIX)
                if not (entry.name.endswith(SUFFIX) and _KEY_NAME.fullmatch(key) and key[:2] == folder.name):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    found.append(StateFile(key, Path(entry.path), info.st_size, info.st_mtime))
        return found

    def evict(self, fit: int | None = None, *, unused_for_s: float | None = None, keep: str | None = None,
              dry_run: bool = False) -> list[StateFile]:
        """Drop states not used for `unused_for_s` seconds, then others in eviction order until
        the state files hold at most `fit` bytes; `keep` is never dropped (and not counted: it is
        being rewritten). One process at a time evicts (a lock file in the folder). What was dropped."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".evict.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            files = {f.key: f for f in self.state_files() if f.key != keep}
            now = time.time()
            order = [str(k) for k in self.uses.order(((k, f.last_used) for k, f in files.items()), now)]
            stale = {k for k, f in files.items() if unused_for_s is not None and now - f.last_used >= unused_for_s}
            held = sum(f.size for f in files.values())
            dropped = []
            for key in [k for k in order if k in stale] + [k for k in order if k not in stale]:
                if key not in stale and (fit is None or held <= fit):
                    break
                held -= files[key].size
                dropped.append(files[key])
                if not dry_run:
                    self.delete(key)
                    self.evictions += 1
            return dropped

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
