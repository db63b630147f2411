"""Tenants as a cryptographic boundary: each tenant's key is derived from the operator's.

The operator holds one key (`$KVRAG_SIGNING_KEY`, or the user's key file). A tenant's key is
HKDF-SHA256 of it, bound to the tenant's name, and written `kvrag-tenant/1:<name>:<64 hex>`;
`kvrag tenant-key NAME` prints one to hand out. Every signature, sealed record and address of a
tenant is made with the tenant's key, so holding one tenant's key reveals nothing of another's,
and naming another tenant's namespace with it finds nothing: another key signs and addresses
there. Whoever holds the operator key can act as any tenant (it derives their keys): that is the
operator. An engine with the operator key and no namespace works as before, under that key.
"""

from __future__ import annotations

import re

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvrag.errors import InputError
from kvrag.trust.signing import resolve_signing_key

__all__ = ["TENANT_KEY_PREFIX", "derive_tenant_key", "tenant_of", "effective_key", "key_for", "check_namespace"]

TENANT_KEY_PREFIX = b"kvrag-tenant/1:"
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")
_TENANT_KEY = re.compile(rb"kvrag-tenant/1:([A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}):[0-9a-f]{64}")


def check_namespace(name: str) -> str:
    """A namespace (a tenant's name): at most 64 letters, digits and _ . -, not starting with a dot."""
    if name and not _NAME.fullmatch(name):
        raise InputError("a namespace holds at most 64 letters, digits and _ . -, and does not start with a dot")
    return name


def derive_tenant_key(operator_key: bytes, tenant: str) -> bytes:
    """The key of `tenant`, derived from the operator's key (HKDF-SHA256, the name as its info)."""
    if not check_namespace(tenant):
        raise InputError("a tenant needs a name")
    if tenant_of(operator_key) is not None:
        raise InputError("a tenant key cannot derive other tenants' keys; derive them from the operator's key")
    secret = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"kvrag-tenant/1", info=tenant.encode()).derive(operator_key)
    return TENANT_KEY_PREFIX + tenant.encode() + b":" + secret.hex().encode()


def tenant_of(key: bytes) -> str | None:
    """The tenant a tenant key belongs to (None: not a tenant key, an operator's)."""
    found = _TENANT_KEY.fullmatch(key.strip())
    return found.group(1).decode() if found else None


def effective_key(key: bytes, namespace: str | None) -> tuple[bytes, str]:
    """What an engine signs and addresses with, and its namespace: a tenant key as it is (its
    tenant's namespace unless another is named, where nothing of that tenant's is found); the
    operator's key as it is without a namespace, else the derived key of the tenant it names."""
    tenant = tenant_of(key)
    if tenant is not None:
        return key.strip(), check_namespace(tenant if not namespace else namespace)
    if not namespace:
        return key, ""
    return derive_tenant_key(key, check_namespace(namespace)), namespace


def key_for(key: bytes | str | None, namespace: str | None) -> tuple[bytes, str]:
    """`effective_key` of the key `resolve_signing_key` finds (`key`, `$KVRAG_SIGNING_KEY`, the
    user's key file): what every reader and writer of a store's namespace signs and checks with."""
    return effective_key(resolve_signing_key(key), namespace)
