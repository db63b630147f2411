"""Tiers by composition: read hot first, write through (or hot only).

The engine reads tier by tier itself, so that a state damaged in one tier is fetched from the next
and only a verified copy is promoted into the hotter tiers. Used directly, this store answers from
the first tier that has the key.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Literal, Sequence

from kvrag.errors import StoreError
from kvrag.stores.base import StateStore, check_blob_name

__all__ = ["TieredStore"]

log = logging.getLogger("kvrag.stores")


class TieredStore(StateStore):
    def __init__(self, tiers: Sequence[StateStore], *, write: Literal["all", "hot"] = "all") -> None:
        if not tiers:
            raise StoreError("a tiered store needs at least one tier")
        self._tiers = list(tiers)
        self.write = write
        self.url = ",".join(t.url for t in self.tiers)

    @property
    def tiers(self) -> list[StateStore]:
        return list(self._tiers)

    def _first(self, fetch: str, key: str) -> Any:
        errors = []
        for tier in self.tiers:
            try:
                value = getattr(tier, fetch)(key)
            except StoreError as e:
                errors.append(str(e))
                continue
            if value is not None:
                return value
        if errors and len(errors) == len(self.tiers):
            raise StoreError("; ".join(errors))
        return None

    def get_manifest(self, key: str) -> bytes | None:
        return self._first("get_manifest", key)

    def get_payload(self, key: str) -> Any | None:
        return self._first("get_payload", key)

    def put(self, key: str, manifest: bytes, payload: bytes) -> None:
        targets = self.tiers if self.write == "all" else self.tiers[:1]
        errors = []
        for tier in targets:
            try:
                tier.put(key, manifest, payload)
            except StoreError as e:
                log.warning("could not write state %s to %s: %s", key[:12], tier.url, e)
                errors.append(str(e))
        if len(errors) == len(targets):
            raise StoreError(f"state {key[:12]} was written to no tier: {'; '.join(errors)}")

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
        check_blob_name(name)
        for index, tier in enumerate(self.tiers):
            try:
                data = tier.get_blob(name)
            except StoreError as e:
                log.warning("cannot read %s from %s: %s", name, tier.url, e)
                continue
            if data is not None:
                for hotter in self.tiers[:index]:
                    try:
                        hotter.put_blob(name, data)
                    except StoreError:
                        pass
                return data
        return None

    def put_blob(self, name: str, data: bytes, *, ttl: int | None = None) -> None:
        targets = self.tiers if self.write == "all" else self.tiers[:1]
        errors = []
        for tier in targets:
            try:
                tier.put_blob(name, data, ttl=ttl)
            except StoreError as e:
                errors.append(str(e))
        if len(errors) == len(targets):
            raise StoreError(f"{name} was written to no tier: {'; '.join(errors)}")

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

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
