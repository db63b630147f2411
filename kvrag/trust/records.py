"""Sealed records: small blobs (memo entries, library entries, cache lines) that a reader
authenticates before trusting. Each is sealed with the signing key and bound to its slot (see
`kvrag.trust.signing.seal`), or, for a confidential engine, encrypted for it (see
`kvrag.trust.confidential`); a record that fails its seal or does not parse is a miss, logged,
never an error in an answer."""

from __future__ import annotations

import logging
from typing import Iterator

from kvrag.errors import SignatureError, StoreError
from kvrag.stores import BlobStore
from kvrag.stores.deadline import Deadline
from kvrag.stores.outages import log_failure
from kvrag.trust.confidential import encrypt_record, is_private_record, open_record
from kvrag.trust.signing import seal, unseal

__all__ = ["SealedRecords"]

log = logging.getLogger("kvrag.records")


class SealedRecords:
    def __init__(self, store: BlobStore, key: bytes, *, allow_unsigned: bool = False, confidential: bool = False) -> None:
        self.store = store
        self.key = key
        self.allow_unsigned = allow_unsigned or bool(getattr(store, "allow_unsigned", False))
        #: records are written encrypted (read either way: both are authenticated under the key)
        self.confidential = confidential

    def get(self, name: str, deadline: Deadline | None = None) -> bytes | None:
        """The body of the record in slot `name`, or None if absent, unreadable, not authentic, or
        not read within `deadline`."""
        try:
            raw = self.store.fetch_blob(name, deadline)
            if raw is None:
                return None
            if is_private_record(raw):
                return open_record(self.key, name, raw)
            return unseal(self.key, name, raw, allow_unsigned=self.allow_unsigned, where=getattr(self.store, "url", ""))
        except SignatureError as e:
            log.warning("refused record: %s", e)
        except StoreError as e:
            log_failure(log, "could not read %s: %s", name, e, error=e)
        return None

    def put(self, name: str, body: bytes, *, ttl: int | None = None) -> None:
        data = encrypt_record(self.key, name, body) if self.confidential else seal(self.key, name, body)
        self.store.put_blob(name, data, ttl=ttl)

    def delete(self, name: str) -> None:
        self.store.delete_blob(name)

    def names(self, namespace: str) -> Iterator[str]:
        return self.store.blob_names(namespace)
