import json

from typer.testing import CliRunner

from kvrag.cli import app

from ..conftest import DOC_A

runner = CliRunner()


def test_help_shows_examples():
    commands = [["verify"], ["demo"], ["deposit"], ["ask"], ["ab"], ["calibrate"], ["ls"], ["inspect"], ["gc"], ["explain"], ["library"],
                ["library", "add"], ["library", "solve"], ["ingest"]]
    for command in commands:
        result = runner.invoke(app, [*command, "--help"])
        assert result.exit_code == 0 and ("Example: kvrag" in result.stdout or "Examples:" in result.stdout), command
        assert f"kvrag {command[0]}" in result.stdout, command


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
    asked = runner.invoke(app, ["ask", "Who built it?", "--doc", str(doc), *common, "--json", "--max-tokens", "3"])
    assert asked.exit_code == 0, asked.output
    receipt = json.loads(asked.stdout)["receipt"]
    assert receipt["mode"] == "exact-graft" and receipt["states"][0]["key"] == key


def test_layout_is_chosen_on_the_command_line_and_shown_by_inspect_and_explain(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC_A)
    common = ["--model", "tiny-random-llama", "--store", f"disk://{tmp_path / 'states'}"]
    deposited = runner.invoke(app, ["deposit", str(doc), *common, "--layout", "completion", "--json"])
    assert deposited.exit_code == 0, deposited.output
    key = json.loads(deposited.stdout)[0]["key"]
    inspected = runner.invoke(app, ["inspect", key, "--store", f"disk://{tmp_path / 'states'}"])
    assert "layout completion" in inspected.stdout
    asked = runner.invoke(app, ["ask", "Who built it?", "--doc", str(doc), *common, "--json", "--max-tokens", "2",
                                "--layout", "completion"])
    assert json.loads(asked.stdout)["receipt"]["layout"] == "completion"
    assert json.loads(asked.stdout)["receipt"]["mode"] == "exact-graft"
    explained = runner.invoke(app, ["explain", "--doc", str(doc), *common, "--json"])  # the chat layout: not stored
    (row,) = json.loads(explained.stdout)["documents"]
    assert row["verdict"] == "reads text" and row["layout"] == "chat"
    assert [d["field"] for d in row["elsewhere"][0]["differences"]] == ["layout", "token_ids"]
    assert "layout: completion stored, chat here" in runner.invoke(app, ["explain", "--doc", str(doc), *common]).stdout
    bad = runner.invoke(app, ["ask", "Who?", "--doc", str(doc), *common, "--layout", "sonnet"])
    assert bad.exit_code == 2 and "sonnet" in bad.output


def test_deposit_of_an_empty_file_fails_cleanly(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    result = runner.invoke(app, ["deposit", str(empty), "--model", "tiny-random-llama", "--store", f"disk://{tmp_path}"])
    assert result.exit_code == 2 and "empty" in result.output
    assert not (tmp_path / "states").exists()


def test_serve_says_who_can_reach_it_and_warns_off_loopback_without_a_key(monkeypatch):
    import uvicorn

    started = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: started.append(kwargs["host"]))  # no socket bound
    common = ["serve", "--model", "tiny-random-llama", "--store", "memory://"]
    quiet = CliRunner().invoke(app, common)
    loud = CliRunner().invoke(app, [*common, "--host", "0.0.0.0"])
    keyed = CliRunner().invoke(app, [*common, "--host", "0.0.0.0", "--api-key", "a-key-0123456789"])
    assert started == ["127.0.0.1", "0.0.0.0", "0.0.0.0"]
    assert "listening on 127.0.0.1 only (loopback)" in quiet.output and "WARNING" not in quiet.output
    assert "WARNING: no --api-key and listening on 0.0.0.0" in loud.output
    assert "1 API keys for 1 tenants" in keyed.output and "WARNING" not in keyed.output
