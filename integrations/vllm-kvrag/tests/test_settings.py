"""The connector's settings: unknown keys refused, a key file read, namespaces from cache salts."""

from __future__ import annotations

import pytest
from vllm_kvrag import ConnectorSettings, namespace_of

from kvrag.trust import check_namespace


def test_unknown_extra_config_keys_are_refused_by_name():
    with pytest.raises(ValueError, match="stor"):
        ConnectorSettings.from_extra_config({"stor": "memory://"})


def test_a_key_file_is_read(tmp_path):
    key = tmp_path / "key"
    key.write_text("s" * 64)
    settings = ConnectorSettings.from_extra_config({"store": "memory://", "signing_key_file": str(key), "namespace": "acme"})
    assert settings.signing_key and settings.namespace == "acme" and settings.store == "memory://"


@pytest.mark.parametrize("salt", ["bob", "x" * 500, "ünï cødé / ..", ""])
def test_a_cache_salt_names_a_valid_namespace_of_its_own(salt):
    for base in ("", "acme", "a" * 64):
        name = namespace_of(base, salt or None)
        assert check_namespace(name) == name
        assert (name == base) == (not salt)
    assert namespace_of("", "bob") != namespace_of("", "alice")
    assert namespace_of("acme", "bob") != namespace_of("other", "bob")


def _config(policy: str = "recompute", extra: dict | None = None, tp: int = 1, backend: str = "uni"):
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(kv_connector="KVRagConnector", kv_connector_module_path="vllm_kvrag.connector",
                                kv_role="kv_both", kv_load_failure_policy=policy,
                                kv_connector_extra_config={"store": "memory://", **(extra or {})})
    return SimpleNamespace(kv_transfer_config=transfer, parallel_config=SimpleNamespace(
        tensor_parallel_size=tp, pipeline_parallel_size=1, distributed_executor_backend=backend))


@pytest.mark.parametrize(("config", "groups", "match"), [
    ({"policy": "fail"}, 1, "kv_load_failure_policy"),
    ({"tp": 2}, 1, "one worker"),
    ({}, 2, "one KV cache group"),
    ({"extra": {"stores": "x"}}, 1, "unknown kv_connector_extra_config"),
    ({"backend": "mp"}, 1, "memory:// store lives in one process"),
])
def test_the_connector_refuses_to_start_where_it_cannot_keep_its_promise(config, groups, match):
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_kvrag import KVRagConnector

    kv_cache = SimpleNamespace(kv_cache_groups=[object()] * groups)
    with pytest.raises(ValueError, match=match):
        KVRagConnector(_config(**config), KVConnectorRole.SCHEDULER, kv_cache)
