"""Looking after a store: list states, inspect one, and collect garbage.

Garbage is what no reader can use: frames that no frame table refers to (a write that was interrupted
or superseded), temporary files of interrupted disk writes, records too damaged to parse and,
on request, states made by other models than the one you keep.
"""

from __future__ import annotations

from typing import Any, Iterator

from pydantic import BaseModel, ValidationError

from kvrag.artifacts.format import decode_payload, parse_manifest
from kvrag.artifacts.payloads import chunking_of
from kvrag.core.protocol import BlendLimits
from kvrag.errors import KVRagError, SignatureError, StateNotFoundError
from kvrag.reuse.gate import GateResult
from kvrag.stores import Accepted, DiskStore, RedisStore, StateStore
from kvrag.trust.confidential import is_private_manifest, open_manifest
from kvrag.trust.records import SealedRecords
from kvrag.trust.signing import check_manifest_bytes
from kvrag.trust.tenants import key_for

__all__ = ["StateInfo", "GcReport", "list_states", "list_gates", "inspect_state", "collect_garbage"]


class StateInfo(BaseModel):
    key: str
    tier: str
    model: str | None = None
    model_fingerprint: str | None = None
    start: int | None = None
    tokens: int | None = None
    parent_key: str | None = None
    payload_bytes: int | None = None
    created_at: str | None = None
    #: the signature, checked on the stored bytes with your key: "valid", "unsigned" or "not your key"
    signature: str | None = None
    #: the manifest is encrypted (a confidential tenant's): without that tenant's key only its sizes show
    encrypted: bool = False
    error: str | None = None


class GcReport(BaseModel):
    dry_run: bool
    orphan_frames: int = 0
    stray_files: int = 0
    damaged_states: list[str] = []
    other_model_states: list[str] = []
    #: states dropped from capped disk tiers (unused too long, or beyond the size asked for), first dropped first
    evicted_states: list[str] = []
    evicted_bytes: int = 0


def signature_verdict(raw: bytes, key: bytes) -> str:
    """What a manifest's signature is, checked on its stored bytes with `key` (never just present)."""
    try:
        return "valid" if check_manifest_bytes(raw, key, allow_unsigned=True, where="kvrag ls") else "unsigned"
    except SignatureError:
        return "not your key"


def _info(tier: StateStore, key: str, signing_key: bytes | None = None) -> StateInfo:
    encrypted = False
    try:
        raw = tier.read_manifest(key)
        if raw is None:
            raise StateNotFoundError("gone")
        encrypted = is_private_manifest(raw)
        if encrypted and signing_key is None:
            return StateInfo(key=key, tier=tier.url, encrypted=True, signature="not your key")
        raw = open_manifest(raw, signing_key, key) if signing_key else raw
        m = parse_manifest(raw)
    except SignatureError as e:
        if encrypted:  # another tenant's: not damaged, only closed to this key
            return StateInfo(key=key, tier=tier.url, encrypted=True, signature="not your key")
        return StateInfo(key=key, tier=tier.url, error=f"{type(e).__name__}: {e}")
    except KVRagError as e:
        return StateInfo(key=key, tier=tier.url, error=f"{type(e).__name__}: {e}")
    return StateInfo(
        key=key, tier=tier.url, model=m.model_fingerprint.name, model_fingerprint=m.model_fingerprint.digest,
        start=m.start, tokens=m.token_count, parent_key=m.parent_key, payload_bytes=m.payload_bytes,
        created_at=m.deposit.created_at, signature=signature_verdict(raw, signing_key) if signing_key else None,
        encrypted=encrypted,
    )


def _reader_key(store: StateStore, signing_key: bytes | str | None, namespace: str | None) -> bytes:
    """The key states are checked with: `signing_key` (default: this user's), or the key it derives
    for `namespace` (default: the store's)."""
    return key_for(signing_key, store.namespace if namespace is None else namespace)[0]


def list_states(store: StateStore, signing_key: bytes | str | None = None,
                namespace: str | None = None) -> Iterator[StateInfo]:
    """Every state in every tier, its signature checked with `signing_key` (default: this user's),
    or with the key it derives for `namespace` (default: the store's)."""
    key = _reader_key(store, signing_key, namespace)
    for tier in store.tiers:
        for state in tier.keys():
            yield _info(tier, state, key)


def list_gates(store: StateStore, signing_key: bytes | str | None = None,
               namespace: str | None = None) -> list[GateResult]:
    """The blend gates' verdicts in `store` that are sealed with `signing_key` (default: this
    user's key; see `kvrag.trust.signing`), oldest first; others are left out. `passed` is as an
    engine with the default `BlendLimits` judges it (a verdict made under looser limits is refused)."""
    records = SealedRecords(store, _reader_key(store, signing_key, namespace))
    gates = []
    for name in records.names("gate"):
        body = records.get(name)
        try:
            if body:
                gate = GateResult.model_validate_json(body)
                gates.append(gate.model_copy(update={"passed": gate.allows(BlendLimits())}))
        except ValidationError:
            continue
    return sorted(gates, key=lambda g: g.at)


def inspect_state(store: StateStore, key: str, signing_key: bytes | str | None = None,
                  namespace: str | None = None) -> dict[str, Any]:
    """The manifest of `key` in each tier that has it, its signature checked on the stored bytes
    with `signing_key` (default: this user's, or the key it derives for `namespace`), and whether
    its payload checks out there."""
    found: dict[str, Any] = {}
    signer = _reader_key(store, signing_key, namespace)
    for tier in store.tiers:
        raw = tier.read_manifest(key)
        if raw is None:
            continue
        entry: dict[str, Any] = {"encrypted": is_private_manifest(raw)}
        try:
            raw = open_manifest(raw, signer, key)
            entry["signature"] = signature_verdict(raw, signer)
            entry["manifest"] = parse_manifest(raw).model_dump(mode="json")

            def opened(stored_raw: bytes) -> Accepted:  # the payload with the manifest of its own write
                manifest = parse_manifest(open_manifest(stored_raw, signer, key))
                return Accepted(manifest, chunking_of(manifest, signer))

            stored = tier.read(key, opened)
            if stored is None or stored.accepted is None:
                entry["payload"] = "missing"
            else:
                chunking = stored.accepted.chunking
                decode_payload(stored.payload, stored.accepted.value, chunking)
                entry["payload"] = f"ok: every chunk passes its {chunking.chunk_opener.name} check and every tensor header " \
                    "matches the manifest" + ("" if entry["signature"] == "valid" else f" (but the signature is {entry['signature']})")
        except KVRagError as e:
            entry.setdefault("signature", "not your key" if isinstance(e, SignatureError) else "unreadable")
            entry["payload"] = entry.get("payload") or f"{type(e).__name__}: {e}"
            entry.setdefault("error", f"{type(e).__name__}: {e}")
        if isinstance(tier, RedisStore):
            frame_table = tier.get_frame_table(key)
            entry["frames"] = len(frame_table.frames) if frame_table else None
        found[tier.url] = entry
    if not found:
        raise StateNotFoundError(f"no state {key} in {store.url}")
    return found


def collect_garbage(store: StateStore, *, keep_fingerprint: str | None = None, dry_run: bool = False,
                    grace_s: float = 600.0, max_bytes: int | None = None, unused_for_s: float | None = None) -> GcReport:
    """Drop what no reader can use. Temporary files and orphan frames younger than `grace_s` may
    belong to a write in progress (its frame table or rename comes last) and are kept. Then, in
    each disk tier, states unused for `unused_for_s` seconds and, in eviction order, others until its
    state files hold at most `max_bytes` (a Redis tier keeps its own bound: `maxmemory`)."""
    report = GcReport(dry_run=dry_run)
    for tier in store.tiers:
        if isinstance(tier, RedisStore):
            orphans = tier.orphan_frames(grace_s)
            report.orphan_frames += len(orphans)
            if not dry_run:
                tier.delete_raw(orphans)
        if isinstance(tier, DiskStore):
            strays = tier.stray_files(grace_s)
            report.stray_files += len(strays)
            if not dry_run:
                for path in strays:
                    path.unlink(missing_ok=True)
        for info in [_info(tier, key) for key in tier.keys()]:
            if info.encrypted and info.model is None:
                continue  # a confidential tenant's state: gc cannot read it, and keeps it
            if info.error:
                report.damaged_states.append(info.key)
            elif keep_fingerprint and info.model_fingerprint != keep_fingerprint:
                report.other_model_states.append(info.key)
            else:
                continue
            if not dry_run:
                tier.delete(info.key)
        if isinstance(tier, DiskStore) and (max_bytes is not None or unused_for_s is not None):
            for dropped in tier.evict(max_bytes, unused_for_s=unused_for_s, dry_run=dry_run):
                report.evicted_states.append(dropped.key)
                report.evicted_bytes += dropped.size
    return report
