"""Tiers by composition: read hot first, write through (or hot only), backfill what passed.

`fetch` walks the tiers with the reader's checks: a state damaged, foreign or unreachable in one
tier is fetched from the next, and only a copy that passed every check is promoted into the
hotter tiers. Blobs are read the same way (the first tier that has one; copied into hotter ones).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Literal, Sequence, TypeVar

from kvrag.errors import StateError, StateNotFoundError, StoreError, StoreUnavailableError
from kvrag.stores.base import Acceptance, BlobStore, Found, ManifestAcceptance, StateStore, StoredState, check_blob_name
from kvrag.stores.deadline import Deadline
from kvrag.stores.outages import log_failure, part_of_an_outage, went_down

__all__ = ["TieredStore"]

log = logging.getLogger("kvrag.stores")

T = TypeVar("T")


class TieredStore(StateStore, BlobStore):
    def __init__(self, tiers: Sequence[StateStore], *, write: Literal["all", "hot"] = "all") -> None:
        if not tiers:
            raise StoreError("a tiered store needs at least one tier")
        self._tiers = list(tiers)
        self.write = write
        self.url = ",".join(t.url for t in self.tiers)
        namespaces = {t.namespace for t in self._tiers}
        if len(namespaces) > 1:
            raise StoreError(f"the tiers of {self.url} name different namespaces ({', '.join(sorted(namespaces))}); "
                             "give each tier the same ?namespace=")
        self.namespace = namespaces.pop()
        self.confidential = any(t.confidential for t in self._tiers)  # one confidential tier: every write is
        self.chunk_bytes = min(t.chunk_bytes for t in self._tiers)

    @property
    def tiers(self) -> list[StateStore]:
        return list(self._tiers)

    def read(self, key: str, accept: ManifestAcceptance | None = None) -> StoredState | None:
        """The first tier's copy (unchecked beyond `check`); `fetch` is the checked, promoting read."""
        errors = []
        for tier in self.tiers:
            try:
                stored = tier.read(key, accept)
            except StoreError as e:
                errors.append(str(e))
                continue
            if stored is not None:
                return stored
        if errors and len(errors) == len(self.tiers):
            raise StoreError("; ".join(errors))
        return None

    def read_manifest(self, key: str) -> bytes | None:
        for tier in self.tiers:
            try:
                raw = tier.read_manifest(key)
            except StoreError:
                continue
            if raw is not None:
                return raw
        return None

    def holds(self, key: str, deadline: Deadline | None = None) -> bool:
        return any(tier.holds(key, deadline) for tier in self.tiers)

    def fetch(self, key: str, acceptance: Acceptance[T], deadline: Deadline | None = None) -> Found[T]:
        """The first copy that passes `check`, tier by tier, all within `deadline`; it is then
        written into the hotter tiers that missed. Raises the most telling `StateError` when no
        tier has a good copy."""
        misses: list[StateError] = []
        for index, tier in enumerate(self.tiers):
            try:
                found = tier.fetch(key, acceptance, deadline)
            except StateError as e:
                misses.append(e.located(key, tier.url))
                continue
            self._promote(key, found.stored, self.tiers[:index])
            return Found(found.value, found.tier, found.stored, tuple(misses))
        telling = [e for e in misses if not isinstance(e, StateNotFoundError)] or misses
        detail = "; ".join(f"{e.tier}: {e}" for e in misses) if len(misses) > 1 else str(telling[0])
        raise type(telling[0])(detail, key=key, tier=telling[0].tier) from telling[0]

    def _promote(self, key: str, stored: StoredState, hotter: Sequence[StateStore]) -> None:
        if not hotter:
            return
        data = stored.payload  # each tier copies what it keeps (a memory tier keeps a checked buffer as is)
        for tier in hotter:
            if tier.breaker.is_open:
                continue
            try:
                tier.put(key, stored.manifest, data)
            except StoreError as e:
                log_failure(log, "could not promote state %s into %s: %s", key[:12], tier.url, e, error=e)

    def put(self, key: str, manifest: bytes, payload: Any) -> None:
        targets = self.tiers if self.write == "all" else self.tiers[:1]
        errors: list[StoreError] = []
        for tier in targets:
            if tier.breaker.is_open:  # it just timed out or failed: do not wait on it again
                errors.append(StoreUnavailableError(f"{tier.url} skipped: {tier.breaker.why}", tier=tier.url))
                continue
            try:
                tier.put(key, manifest, payload)
            except StoreError as e:
                self.report_failure(tier, e)
                errors.append(e)
        if len(errors) == len(targets):
            raise _written_nowhere(f"state {key[:12]}", errors)

    def delete(self, key: str) -> None:
        for tier in self.tiers:
            tier.delete(key)

    def keys(self) -> Iterator[str]:
        seen: set[str] = set()
        for tier in self.tiers:
            try:
                for key in tier.keys():
                    if key not in seen:
                        seen.add(key)
                        yield key
            except StoreError as e:
                log.warning("cannot list %s: %s", tier.url, e)

    def get_blob(self, name: str) -> bytes | None:
        return self.fetch_blob(name)

    def fetch_blob(self, name: str, deadline: Deadline | None = None) -> bytes | None:
        """The first tier's copy, each tier read within `deadline` (a tier that fails is skipped)."""
        check_blob_name(name)
        for index, tier in enumerate(self.tiers):
            try:
                data = tier.fetch_blob(name, deadline)  # type: ignore[attr-defined]
            except StoreError as e:
                self.report_failure(tier, e)
                continue
            if data is not None:
                for hotter in self.tiers[:index]:
                    if hotter.breaker.is_open:
                        continue
                    try:
                        hotter.put_blob(name, data)  # type: ignore[attr-defined]
                    except StoreError:
                        pass
                return data
        return None

    def put_blob(self, name: str, data: bytes, *, ttl: int | None = None) -> None:
        targets = self.tiers if self.write == "all" else self.tiers[:1]
        errors: list[StoreError] = []
        for tier in targets:
            try:
                tier.put_blob(name, data, ttl=ttl)
            except StoreError as e:
                self.report_failure(tier, e)
                errors.append(e)
        if len(errors) == len(targets):
            raise _written_nowhere(name, errors)

    def delete_blob(self, name: str) -> None:
        for tier in self.tiers:
            try:
                tier.delete_blob(name)
            except StoreError as e:
                log.warning("cannot delete %s from %s: %s", name, tier.url, e)

    def blob_names(self, namespace: str) -> Iterator[str]:
        seen: set[str] = set()
        for tier in self.tiers:
            try:
                for name in tier.blob_names(namespace):
                    if name not in seen:
                        seen.add(name)
                        yield name
            except StoreError as e:
                log.warning("cannot list %s: %s", tier.url, e)

    def report_failure(self, tier: StateStore, error: StoreError) -> None:
        """Warn once that `tier` failed, until it answers again (see `kvrag.stores.outages`); an
        outage its breaker already reported is not reported again."""
        if not part_of_an_outage(error):
            went_down(tier.url, str(error))

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


def _written_nowhere(what: str, errors: list[StoreError]) -> StoreError:
    """The error for a write no tier took: `StoreUnavailableError` when every tier was down."""
    kind = StoreUnavailableError if all(part_of_an_outage(e) for e in errors) else StoreError
    return kind(f"{what} was written to no tier: {'; '.join(str(e) for e in errors)}")

