"""HMAC-SHA256 on everything a stored byte can steer: a shared store is a trust boundary.

Whoever can write to a store could otherwise steer the model invisibly: plant a state, rewrite a
memo entry, edit a cache line. So kvrag signs by default. The key is `KVEngine(signing_key=...)`,
else `KVRAG_SIGNING_KEY`, else the file `KVRAG_SIGNING_KEY_FILE` names, else a random per-user key
created once in kvrag's home folder (owner-only permissions). Keys are part of every state's
address, so machines that share a store must share a key: the same `KVRAG_SIGNING_KEY`, or a copy
of one key file (`--signing-key-file`). An engine on a store other machines can reach (a Redis
on a host other than loopback) whose key was generated on this machine warns at start-up
(`warn_if_unshared`). An empty key is an error, never "no signing".

- State manifests carry a `signature`: a MAC over the manifest's stored bytes with that field
  `null` (the manifest commits to the payload's chunk digests, so the payload is covered too). It
  is checked on the bytes read, before they are parsed, so no re-encoding is ever trusted.
- Small records (memo entries, library entries, cache lines) are sealed: an envelope whose MAC
  covers the record's body and the name of the slot it was written to, so an entry copied into
  another slot fails like a rewritten one.

Unsigned data is refused unless the reader opts in (`allow_unsigned=True`, `?allow_unsigned=1`),
which logs a warning once per store.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
import socket
from pathlib import Path
from urllib.parse import urlsplit

from kvrag.artifacts.format import StateManifest
from kvrag.errors import InputError, SignatureError
from kvrag.paths import kvrag_home
from kvrag.stores.outages import public_url

__all__ = ["KEY_ENV", "KEY_FILE_ENV", "resolve_signing_key", "read_key_file", "default_key_path", "generated_here", "warn_if_unshared",
           "sign_manifest", "sign_manifest_bytes", "check_manifest_bytes", "mac", "seal", "unseal",
           "warn_unsigned_once"]

log = logging.getLogger("kvrag.signing")

KEY_ENV = "KVRAG_SIGNING_KEY"
KEY_FILE_ENV = "KVRAG_SIGNING_KEY_FILE"
_SEALED = b"kvrag.sealed/1 "
_warned: set[str] = set()
#: the schemes of stores that other machines can reach
_SHARED_SCHEMES = ("redis://", "rediss://", "redis+cluster://")


def default_key_path() -> Path:
    return kvrag_home() / "signing.key"


def _origin_path() -> Path:
    """Names the host that generated the default key: a copied key file comes without it."""
    return kvrag_home() / "signing.key.origin"


def generated_here() -> bool:
    """Whether this user's default key file may have been generated on this host: it was, or nothing
    says where (a key made before origins were noted). Only a key whose origin names another host
    was shared on purpose."""
    if not default_key_path().exists():
        return True  # it will be generated here on first use
    try:
        return _origin_path().read_text(encoding="utf-8").strip() in ("", socket.gethostname())
    except OSError:
        return True


def _uses_default_key(key: bytes | str | None) -> bool:
    return key is None and os.environ.get(KEY_ENV) is None and not os.environ.get(KEY_FILE_ENV)


def _reachable_from_elsewhere(url: str) -> bool:
    """Whether other machines can reach the store at `url`: a Redis URL naming a host other than
    this machine's loopback (a Redis on 127.0.0.1 or localhost serves this machine only)."""
    if not url.startswith(_SHARED_SCHEMES):
        return False
    netloc = urlsplit(url.split("?", 1)[0]).netloc.rsplit("@", 1)[-1]
    for item in netloc.split(","):
        try:
            host = urlsplit("//" + item).hostname or ""
        except ValueError:  # not a host we can read: it may be anywhere
            return True
        if host != "localhost" and not _is_loopback(host):
            return True
    return False


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_unshared(key: bytes | str | None, store_urls: list[str]) -> str | None:
    """Warn (once per store) when `key` resolves to a key generated on this machine and a store is
    one other machines reach (a Redis on another host than this one's loopback): they would
    neither see nor graft its states. Returns the warning."""
    shared = [public_url(url) for url in store_urls if _reachable_from_elsewhere(url)]
    if not shared or not _uses_default_key(key) or not generated_here():
        return None
    path = default_key_path()
    message = (f"the signing key {path} was generated on this machine, and {', '.join(shared)} is shared: other "
               "machines will neither see nor graft the states stored there under it, nor this one theirs. Give "
               f"every machine the same key: copy {path} to each and pass --signing-key-file (or set "
               f"{KEY_FILE_ENV}, or {KEY_ENV} to one shared secret)")
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)
    return message


def _default_key() -> bytes:
    """This user's key, created once (32 random bytes, hex, mode 0600); concurrent first runs agree."""
    path = default_key_path()
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            try:
                os.link(tmp, path)  # never replaces a key another process made first
                _origin_path().write_text(socket.gethostname() + "\n", encoding="utf-8")
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
    key = path.read_bytes().strip()
    if not key:
        raise InputError(f"the signing key file {path} is empty; delete it to have a new one made")
    return key


def read_key_file(path: str) -> bytes:
    """A signing key file's key (`--signing-key-file`, `$KVRAG_SIGNING_KEY_FILE`): its bytes,
    stripped; an unreadable or empty file is an `InputError`."""
    try:
        key = Path(path).expanduser().read_bytes().strip()
    except OSError as e:
        raise InputError(f"cannot read the signing key file {path}: {e.strerror or e}") from e
    if not key:
        raise InputError(f"the signing key file {path} is empty; put the shared secret in it")
    return key


def resolve_signing_key(key: bytes | str | None = None) -> bytes:
    """The key to sign with: `key`, else `$KVRAG_SIGNING_KEY`, else the file `$KVRAG_SIGNING_KEY_FILE`
    names, else this user's key file."""
    if key is None:
        env = os.environ.get(KEY_ENV)
        if env is not None and not env.strip():
            raise InputError(f"{KEY_ENV} is set but empty; set it to a shared secret, or unset it to use "
                             f"this user's key ({default_key_path()})")
        if env is not None:
            key = env
        elif os.environ.get(KEY_FILE_ENV):
            key = read_key_file(os.environ[KEY_FILE_ENV])
        else:
            key = _default_key()
    data = key.encode() if isinstance(key, str) else bytes(key)
    if not data.strip():
        raise InputError("an empty signing key would let anyone sign; pass a secret, or None for this user's key")
    return data


def mac(key: bytes, domain: bytes, *parts: bytes) -> str:
    digest = hmac.new(key, domain, hashlib.sha256)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()


#: The manifest's signature field as it appears in stored bytes (any JSON whitespace around the colon).
_SIGNATURE_FIELD = re.compile(rb'"signature"\s*:\s*("(?:[0-9a-f]{64})"|null)')


def _manifest_mac(unsigned: bytes, key: bytes) -> str:
    return mac(key, b"kvrag-manifest", unsigned)


def sign_manifest(manifest: StateManifest, key: bytes) -> StateManifest:
    """`manifest` with its signature: a MAC over the bytes it is stored as (`to_json_bytes`) with
    the signature field `null`."""
    unsigned = manifest.model_copy(update={"signature": None}).to_json_bytes()
    return manifest.model_copy(update={"signature": _manifest_mac(unsigned, key)})


def sign_manifest_bytes(raw: bytes, key: bytes) -> bytes:
    """Manifest bytes in any encoding, signed: their one `"signature": null` field gets the MAC
    over exactly these bytes. What a reader checks is the stored bytes, not a re-encoding."""
    fields = list(_SIGNATURE_FIELD.finditer(raw))
    if len(fields) != 1 or fields[0].group(1) != b"null":
        raise InputError("manifest bytes to sign need exactly one signature field, set to null")
    at = fields[0].span(1)
    return raw[: at[0]] + b'"' + _manifest_mac(raw, key).encode() + b'"' + raw[at[1] :]


def warn_unsigned_once(where: str) -> None:
    if where not in _warned:
        _warned.add(where)
        log.warning("reading unsigned data from %s (allow_unsigned is on): anyone who can write there can "
                    "steer answers", where)


def check_manifest_bytes(raw: bytes, key: bytes, *, allow_unsigned: bool = False, where: str = "") -> str | None:
    """Authenticate stored manifest bytes before they are parsed: their signature must be the MAC,
    under `key`, of these very bytes with the signature `null`. Raise `SignatureError` (and log it)
    otherwise; return the signature (None for an unsigned manifest, passed only with
    `allow_unsigned`, a warning logged once per `where`)."""
    raw = bytes(raw)
    fields = list(_SIGNATURE_FIELD.finditer(raw))
    if len(fields) != 1:
        log.warning("refused a manifest from %s: %d signature fields", where or "a store", len(fields))
        raise SignatureError(f"a stored manifest holds {len(fields)} signature fields; it is refused")
    value, (start, end) = fields[0].group(1), fields[0].span(1)
    if value == b"null":
        if allow_unsigned:
            warn_unsigned_once(where)
            return None
        log.warning("refused an unsigned manifest from %s", where or "a store")
        raise SignatureError("the state is unsigned; it is refused (allow_unsigned=True reads unsigned states)")
    signature = value.strip(b'"').decode()
    if not hmac.compare_digest(signature, _manifest_mac(raw[:start] + b"null" + raw[end:], key)):
        log.warning("refused a manifest from %s: its signature does not match", where or "a store")
        raise SignatureError("the state has a signature that does not match this key; it is refused")
    return signature


def seal(key: bytes, name: str, body: bytes) -> bytes:
    """A record bound to its slot `name`: `kvrag.sealed/1 <mac>\\n<body>`."""
    return _SEALED + mac(key, b"kvrag-record", name.encode(), body).encode() + b"\n" + body


def unseal(key: bytes, name: str, data: bytes, *, allow_unsigned: bool = False, where: str = "") -> bytes:
    """The body of a record sealed for slot `name` with `key`; `SignatureError` otherwise."""
    data = bytes(data)
    if not data.startswith(_SEALED):
        if allow_unsigned:
            warn_unsigned_once(where)
            return data
        raise SignatureError(f"{name} is not sealed; it is refused")
    tag, newline, body = data[len(_SEALED):].partition(b"\n")
    if not newline or not hmac.compare_digest(tag, mac(key, b"kvrag-record", name.encode(), body).encode()):
        raise SignatureError(f"{name} has a seal that does not match this key and slot; it is refused")
    return body
