"""One key story on the command line: every command that signs, seals or addresses states takes
`--signing-key-file` and `--namespace` where a namespace applies, and finds the key in the
library's one order (the key given, `KVRAG_SIGNING_KEY`, the file `KVRAG_SIGNING_KEY_FILE` names,
this user's key file)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvrag import KVEngine
from kvrag.cli.main import app
from kvrag.trust import derive_tenant_key, resolve_signing_key
from tests.conftest import DOC_A, tiny

runner = CliRunner()


def test_tenant_key_derives_from_the_key_file_given_else_from_the_librarys_order(tmp_path, monkeypatch):
    monkeypatch.delenv("KVRAG_SIGNING_KEY", raising=False)
    monkeypatch.delenv("KVRAG_SIGNING_KEY_FILE", raising=False)
    fleet = tmp_path / "fleet.key"
    fleet.write_text("fleet-secret-0123456789abcdef\n")
    given = runner.invoke(app, ["tenant-key", "acme", "--signing-key-file", str(fleet)])
    assert given.exit_code == 0, given.output
    assert given.stdout.strip() == derive_tenant_key(b"fleet-secret-0123456789abcdef", "acme").decode()
    other = tmp_path / "other.key"
    other.write_text("other-secret-0123456789abcdef\n")
    both = {"KVRAG_SIGNING_KEY": "env-secret-0123456789abcdef", "KVRAG_SIGNING_KEY_FILE": str(other)}
    for name, value in both.items():
        monkeypatch.setenv(name, value)
    # both set: the secret wins, on the command line as in the library
    from_env = runner.invoke(app, ["tenant-key", "acme"])
    assert from_env.stdout.strip() == derive_tenant_key(resolve_signing_key(None), "acme").decode() \
        == derive_tenant_key(b"env-secret-0123456789abcdef", "acme").decode()
    monkeypatch.delenv("KVRAG_SIGNING_KEY")
    assert runner.invoke(app, ["tenant-key", "acme"]).stdout.strip() == \
        derive_tenant_key(b"other-secret-0123456789abcdef", "acme").decode()
    # the file given wins over both
    monkeypatch.setenv("KVRAG_SIGNING_KEY", "env-secret-0123456789abcdef")
    assert runner.invoke(app, ["tenant-key", "acme", "--signing-key-file", str(fleet)]).stdout.strip() == \
        given.stdout.strip()


def test_ls_and_inspect_check_signatures_with_the_tenant_key_named(tmp_path, monkeypatch):
    monkeypatch.delenv("KVRAG_SIGNING_KEY", raising=False)
    monkeypatch.delenv("KVRAG_SIGNING_KEY_FILE", raising=False)
    fleet = tmp_path / "fleet.key"
    fleet.write_text("fleet-secret-0123456789abcdef\n")
    store = f"disk://{tmp_path / 'states'}"
    with KVEngine(tiny("llama"), store, signing_key=b"fleet-secret-0123456789abcdef", namespace="acme") as engine:
        ref = engine.deposit(DOC_A)
    common = ["--store", store, "--signing-key-file", str(fleet), "--json"]
    mine = json.loads(runner.invoke(app, ["ls", *common, "--namespace", "acme"]).stdout)
    assert [(s["key"], s["signature"]) for s in mine] == [(ref.key, "valid")]
    # the operator's own key (no namespace) is not the tenant's: the signature does not check
    assert {s["signature"] for s in json.loads(runner.invoke(app, ["ls", *common]).stdout)} == {"not your key"}
    shown = json.loads(runner.invoke(app, ["inspect", ref.key, *common, "--namespace", "acme"]).stdout)
    (entry,) = shown.values()
    assert entry["signature"] == "valid" and entry["payload"].startswith("ok")
    other = json.loads(runner.invoke(app, ["inspect", ref.key, *common, "--namespace", "globex"]).stdout)
    assert all(e.get("signature") != "valid" for e in other.values())
