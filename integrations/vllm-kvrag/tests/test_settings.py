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
