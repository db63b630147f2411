"""Trust: signing keys and MACs (`signing`), tenants' keys derived from the operator's (`tenants`),
sealed records beside the states (`records`), and an engine's identity, whose key scope every
address is derived from (`identity`)."""

from kvrag.trust.identity import EngineIdentity, key_scope
from kvrag.trust.records import SealedRecords
from kvrag.trust.signing import KEY_ENV, read_key_file, resolve_signing_key
from kvrag.trust.tenants import check_namespace, derive_tenant_key, effective_key, key_for, tenant_of

__all__ = ["EngineIdentity", "key_scope", "SealedRecords", "KEY_ENV", "read_key_file", "resolve_signing_key", "check_namespace", "derive_tenant_key",
           "effective_key", "key_for", "tenant_of"]
