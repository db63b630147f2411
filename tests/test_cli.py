import json

from typer.testing import CliRunner

from kvrag.cli import app

from .conftest import DOC_A

runner = CliRunner()


def test_help_shows_examples():
    commands = [["verify"], ["demo"], ["deposit"], ["ask"], ["ab"], ["ls"], ["inspect"], ["gc"], ["library"],
                ["library", "add"], ["library", "solve"]]
    for command in commands:
        result = runner.invoke(app, [*command, "--help"])
        assert result.exit_code == 0 and "Example: kvrag" in result.stdout, command


def test_user_errors_print_one_line_without_a_traceback():
    result = runner.invoke(app, ["verify", "--model", "tiny-random-nonesuch", "--samples", "1"])
    assert result.exit_code == 2
    assert "error:" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["verify", "--model", "tiny-random-llama", "--dtype", "float8"])
    assert result.exit_code == 2 and "float8" in result.output


def test_deposit_then_ask_grafts(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC_A)
    store = f"disk://{tmp_path / 'states'}"
    common = ["--model", "tiny-random-llama", "--store", store]
    deposited = runner.invoke(app, ["deposit", str(doc), *common, "--json"])
    assert deposited.exit_code == 0, deposited.output
    key = json.loads(deposited.stdout)[0]["key"]
    asked = runner.invoke(app, ["ask", "Who built it?", "--doc", str(doc), *common, "--json", "--max-new-tokens", "3"])
    assert asked.exit_code == 0, asked.output
    receipt = json.loads(asked.stdout)["receipt"]
    assert receipt["mode"] == "exact-graft" and receipt["states"][0]["key"] == key


def test_deposit_of_an_empty_file_fails_cleanly(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    result = runner.invoke(app, ["deposit", str(empty), "--model", "tiny-random-llama", "--store", f"disk://{tmp_path}"])
    assert result.exit_code == 2 and "empty" in result.output
    assert not (tmp_path / "states").exists()


def test_ls_inspect_and_gc(redis_server, tmp_path):
    import redis as redis_py

    from kvrag import KVEngine
    from kvrag.stores.disk import DiskStore

    from .conftest import DOC_B, tiny

    store = f"{redis_server.url}?frame_mib=0.01,disk://{tmp_path}"
    ours = KVEngine(tiny("llama"), store).deposit(DOC_A)
    theirs = KVEngine(tiny("qwen2"), store).deposit(DOC_B)
    listed = json.loads(runner.invoke(app, ["ls", "--store", store, "--json"]).stdout)
    assert {(i["key"], i["tier"].split(":")[0]) for i in listed} == {
        (ours.key, "redis"), (ours.key, "disk"), (theirs.key, "redis"), (theirs.key, "disk")}
    table = runner.invoke(app, ["ls", "--store", store])
    assert table.exit_code == 0 and "4 states" in table.stdout

    inspected = json.loads(runner.invoke(app, ["inspect", ours.key, "--store", store, "--json"]).stdout)
    assert len(inspected) == 2 and all(e["payload"].startswith("ok") for e in inspected.values())
    missing = runner.invoke(app, ["inspect", "0" * 64, "--store", store])
    assert missing.exit_code == 2 and "no state" in missing.output

    # Leave garbage: an orphan frame in Redis and a stray temporary file on disk.
    raw = redis_py.Redis(port=redis_server.port)
    raw.set(f"kvrag:{{{ours.key}}}:f:deadbeefdeadbeef:0", b"x")
    (tmp_path / "states" / ours.key[:2] / ".interrupted.tmp").write_bytes(b"partial")
    dry = json.loads(runner.invoke(app, ["gc", "--store", store, "--dry-run", "--json"]).stdout)
    assert dry["orphan_frames"] == 1 and dry["stray_files"] == 1
    done = runner.invoke(app, ["gc", "--store", store, "--other-models", "--model", "tiny-random-llama", "--json"])
    report = json.loads(done.stdout)
    assert report["orphan_frames"] == 1 and report["other_model_states"] == [theirs.key, theirs.key]
    assert raw.get(f"kvrag:{{{ours.key}}}:f:deadbeefdeadbeef:0") is None
    assert list(DiskStore(tmp_path).keys()) == [ours.key]
    assert KVEngine(tiny("llama"), store).generate("Who?", states=[ours], max_new_tokens=1).receipt.mode == "exact-graft"
