"""API keys: `Authorization: Bearer <key>` names a tenant, compared in constant time.

With keys configured (`ServeSettings.api_keys`), every route needs one (`/health` and `/metrics`
too, unless `open_health`); a missing or wrong key is a 401 in OpenAI's shape.
"""

from __future__ import annotations

import hmac
from typing import Sequence

from kvrag.server.settings import ApiKey, ServeSettings

__all__ = ["authorized_tenant", "needs_key", "UNAUTHORIZED"]

UNAUTHORIZED = ("Incorrect or missing API key: send `Authorization: Bearer <key>` with a key this server was "
                "started with (kvrag serve --api-key)")


def authorized_tenant(keys: Sequence[ApiKey], authorization: str | None) -> str | None:
    """The tenant of `Authorization: Bearer <key>`, or None if it names no key here. Every key is
    compared, in constant time, whichever matches."""
    scheme, _, token = (authorization or "").partition(" ")
    presented = token.strip().encode() if scheme.lower() == "bearer" else b""
    found = None
    for entry in keys:
        if hmac.compare_digest(entry.key.encode(), presented) and presented:
            found = entry.tenant
    return found


def needs_key(settings: ServeSettings, path: str) -> bool:
    """Whether a request to `path` must present a key."""
    return bool(settings.api_keys) and (path.startswith("/v1") or not settings.open_health)
