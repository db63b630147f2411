"""Where else a text's state is stored: "why did this not graft?"

A state is found only under its own key, a hash of the engine's scope (model and hardware
fingerprints, signing key, namespace), its parent chain and its token ids. So a state deposited
with another dtype, kernel, thread count or prompt layout, or at another position, is simply not
found, and the answer reads text. To say why, every deposit also notes its key in a small sealed
record addressed by the text (`where/<MAC of the text's SHA-256 under the signing key>`, the most
recent `MAX_KEYS` keys). For a segment read as text, the noted keys' manifests are read, their
signatures checked with this engine's key (nothing unsigned or signed with another key is read),
and each is compared field by field with what this engine needed.

What this cannot read, by design: states of another namespace or signing key (their records and
manifests are sealed with a key this engine does not hold; tenants are a cryptographic boundary).
It can say that they exist: every deposit that is not confidential also adds its *mark* to an
unsigned hint, `seen/<SHA-256 of the text>`. A mark is a MAC of the text's digest under the
depositor's key, so it tells one depositor's deposits of this text from another's and nothing
more: it links no two texts, and names no key, namespace or model. A hint whose marks are not this
engine's says the text was stored under another signing key or namespace. What the hint reveals
(that a text was deposited, and by how many keys) a reader of the store can already learn from the
states' manifests, which carry their token ids in the clear; a confidential engine writes no hint.
Anyone who can write to the store can forge a hint: it only ever changes a diagnostic sentence.

Both are diagnostic indexes: two deposits of the same text racing may drop one key or mark; nothing
that grafts depends on them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict

from kvrag.artifacts.format import parse_manifest
from kvrag.core.schedule import Segment
from kvrag.errors import KVRagError
from kvrag.stores import UNTRUSTED_PARSE_ERRORS, StateStore
from kvrag.stores.deadline import Deadline, bounded
from kvrag.stores.outages import log_failure
from kvrag.trust.confidential import open_manifest
from kvrag.trust.identity import EngineIdentity
from kvrag.trust.records import SealedRecords
from kvrag.trust.signing import check_manifest_bytes, mac

__all__ = ["Whereabouts", "Sighting", "Difference", "MAX_KEYS", "MAX_MARKS", "foreign_sentence"]

log = logging.getLogger("kvrag.whereabouts")

#: the most keys one text's record keeps (the most recent deposits)
MAX_KEYS = 16
_MAX_RECORD_BYTES = 64 * MAX_KEYS + 64
#: the most marks a text's unsigned hint keeps, and a mark's length (hex)
MAX_MARKS = 16
_MARK_HEX = 32
_MAX_HINT_BYTES = (_MARK_HEX + 4) * MAX_MARKS + 16


class Difference(BaseModel):
    """One field in which a stored state differs from what this engine needed."""

    model_config = ConfigDict(frozen=True)

    field: str
    stored: str
    needed: str


class Sighting(BaseModel):
    """A signed state of the same text, and how it differs from the one this engine looked for."""

    model_config = ConfigDict(frozen=True)

    key: str
    model: str
    start: int
    token_count: int
    layout: str | None
    differences: list[Difference]

    def describe(self) -> str:
        if not self.differences:
            return f"state {self.key[:12]} matches every field (it was deposited in this scope but is not readable)"
        parts = ", ".join(f"{d.field} ({d.stored} stored, {d.needed} here)" for d in self.differences[:4])
        more = f" and {len(self.differences) - 4} more" if len(self.differences) > 4 else ""
        return f"state {self.key[:12]} differs in {parts}{more}"


class Whereabouts:
    """Notes where each deposited text's states are, and compares them with a segment's needs."""

    def __init__(self, store: StateStore, records: SealedRecords, identity: EngineIdentity, signing_key: bytes) -> None:
        self.store = store
        self.records = records
        self.identity = identity
        self.signing_key = signing_key

    def slot(self, text: str) -> str:
        """The record's name: a MAC of the text's digest, so it reveals nothing of the text."""
        digest = hashlib.sha256(text.encode()).digest()
        return "where/" + mac(self.signing_key, b"kvrag-where", digest)

    def _keys(self, slot: str, deadline: Deadline | None) -> list[str]:
        body = self.records.get(slot, deadline)
        if not body or len(body) > _MAX_RECORD_BYTES:
            return []
        try:
            keys = json.loads(body)
        except UNTRUSTED_PARSE_ERRORS:  # a deeply nested body too: a miss, never an error in an answer
            return []
        if not isinstance(keys, list):
            return []
        return [k for k in keys[:MAX_KEYS] if isinstance(k, str) and len(k) == 64 and all(c in "0123456789abcdef" for c in k)]

    def note(self, segment: Segment) -> None:
        """Record that `segment`'s state is stored (best effort: a store failure is logged)."""
        slot = self.slot(segment.text)
        try:
            keys = [k for k in self._keys(slot, None) if k != segment.key]
            keys = [segment.key, *keys][:MAX_KEYS]
            self.records.put(slot, json.dumps(keys).encode())
            if not self.records.confidential:
                self._add_mark(segment.text)
        except KVRagError as e:
            log_failure(log, "could not note where state %s is: %s", segment.key[:12], e, error=e)

    @staticmethod
    def hint_slot(text: str) -> str:
        """The unsigned hint's name: anyone holding the text can compute it (see the module docstring)."""
        return "seen/" + hashlib.sha256(b"kvrag-seen/1\x00" + text.encode()).hexdigest()

    def mark(self, text: str) -> str:
        """This key's mark for `text`: unlinkable across texts, meaningless without the key."""
        return mac(self.signing_key, b"kvrag-seen-mark", hashlib.sha256(text.encode()).digest())[:_MARK_HEX]

    def marks(self, text: str, deadline: Deadline | None = None) -> list[str]:
        """The marks in `text`'s hint: untrusted, bounded, anything malformed read as none."""
        try:
            raw = self.records.store.fetch_blob(self.hint_slot(text), deadline)
        except KVRagError:
            return []
        if not raw or len(raw) > _MAX_HINT_BYTES:
            return []
        try:
            marks = json.loads(bytes(raw))
        except UNTRUSTED_PARSE_ERRORS:
            return []
        if not isinstance(marks, list):
            return []
        return [m for m in marks[:MAX_MARKS]
                if isinstance(m, str) and len(m) == _MARK_HEX and all(c in "0123456789abcdef" for c in m)]

    def _add_mark(self, text: str) -> None:
        mine = self.mark(text)
        marks = self.marks(text)
        if mine not in marks:
            self.records.store.put_blob(self.hint_slot(text), json.dumps([mine, *marks][:MAX_MARKS]).encode())

    def other_keys(self, segment: Segment, deadline: Deadline | None = None) -> int:
        """How many other signing keys or namespaces stored `segment`'s text (0 if none, or unknown)."""
        mine = self.mark(segment.text)
        return sum(1 for m in self.marks(segment.text, deadline) if m != mine)

    def sightings(self, segment: Segment, deadline: Deadline | None = None, limit: int = MAX_KEYS) -> list[Sighting]:
        """The signed states of `segment`'s text under other keys (the `limit` most recent), each
        with its differences."""
        found: list[Sighting] = []
        for key in self._keys(self.slot(segment.text), deadline):
            if len(found) >= limit or (deadline is not None and deadline.expired):
                break
            if key == segment.key:
                continue
            try:
                raw = bounded(lambda key=key: self.store.read_manifest(key), deadline, f"reading state {key[:12]}'s manifest")
                if raw is None:
                    continue
                raw = open_manifest(raw, self.signing_key, key)
                check_manifest_bytes(raw, self.signing_key, where=self.store.url)
                manifest = parse_manifest(raw)
            except KVRagError:
                continue  # gone, unsigned, signed with another key, or unparseable: not read
            found.append(Sighting(key=key, model=manifest.model_fingerprint.name, start=manifest.start,
                                  token_count=manifest.token_count, layout=manifest.prompt_layout,
                                  differences=differences(manifest, segment, self.identity)))
        return found

    def describe(self, segment: Segment, deadline: Deadline | None = None) -> str:
        """One sentence for a receipt: what is stored for this text under other settings, if anything."""
        seen = self.sightings(segment, deadline, limit=3)
        if not seen:
            others = self.other_keys(segment, deadline)
            return foreign_sentence(others) if others else ""
        return "Stored for the same text under other settings: " + "; ".join(s.describe() for s in seen) + "."


def foreign_sentence(others: int) -> str:
    """What a receipt and `kvrag explain` say when only other keys stored a text."""
    under = "another signing key or namespace" if others == 1 else f"{others} other signing keys or namespaces"
    return (f"This text was stored under {under}, which this engine cannot read: machines and tenants share "
            "states only when they share a signing key (--signing-key-file, KVRAG_SIGNING_KEY) and namespace.")


def _fields(prefix: str, stored: dict[str, Any], needed: dict[str, Any]) -> list[Difference]:
    return [Difference(field=f"{prefix}.{name}", stored=_short(stored.get(name)), needed=_short(value))
            for name, value in needed.items() if name != "digest" and stored.get(name) != value]


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text[:16] if len(text) == 64 else text[:80]


def differences(manifest: Any, segment: Segment, identity: EngineIdentity) -> list[Difference]:
    """Every field in which a stored manifest differs from what `segment` needs under `identity`."""
    diffs = _fields("model", manifest.model_fingerprint.model_dump(), identity.model.model_dump())
    diffs += _fields("hardware", manifest.hardware_fingerprint.model_dump(), identity.hardware.model_dump())
    if (manifest.prompt_layout or "") != segment.layout:
        diffs.append(Difference(field="layout", stored=manifest.prompt_layout or "unnamed", needed=segment.layout))
    if manifest.start != segment.start:
        diffs.append(Difference(field="start", stored=str(manifest.start), needed=str(segment.start)))
    if manifest.parent_key != segment.parent_key:
        diffs.append(Difference(field="parent", stored=(manifest.parent_key or "none")[:12],
                                needed=(segment.parent_key or "none")[:12]))
    if list(manifest.token_ids) != list(segment.ids):
        diffs.append(Difference(field="token_ids", stored=f"{manifest.token_count} tokens",
                                needed=f"{len(segment.ids)} tokens{_first_difference(manifest.token_ids, segment.ids)}"))
    return diffs


def _first_difference(stored: Sequence[int], needed: Sequence[int]) -> str:
    for index, (a, b) in enumerate(zip(stored, needed)):
        if a != b:
            return f" (first different at token {index})"
    return ""
