"""The command line's conventions: fast help, a version, choices, one meaning per flag, the trust
options, `ask` depositing, and a store outage said once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvrag.cli import app

from ..conftest import DOC_A

runner = CliRunner()


def test_help_and_version_answer_without_importing_torch():
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom kvrag.cli import app\n"
            "for args in (['--help'], ['ask', '--help'], ['ab', '--help'], ['serve', '--help'], ['--version']):\n"
            "    assert CliRunner().invoke(app, args).exit_code == 0, args\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from kvrag.version import VERSION

    assert runner.invoke(app, ["--version"]).stdout.strip() == f"kvrag {VERSION}"


def test_enumerated_options_show_and_check_their_choices():
    shown = runner.invoke(app, ["ab", "--help"], env={"COLUMNS": "200"}).stdout
    for choices in ("float32|bfloat16|float16", "invariant|sdpa|eager", "chat|completion", "lazy|warm",
                    "retrieval|stored-first"):
        assert choices in shown, choices
    bad = runner.invoke(app, ["ab", "--policy", "eager-beaver"])
    assert bad.exit_code == 2 and "eager-beaver" in bad.output


def test_one_token_limit_name_and_json_prints_everywhere():
    for command in ("ask", "ab", "serve"):
        shown = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).stdout
        assert "--max-tokens" in shown and "--max-new-tokens" not in shown, command
    for command in ("verify", "deposit", "ask", "explain", "ab", "calibrate", "ls", "inspect", "gc"):
        shown = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).stdout
        assert "--json" in shown and "print one JSON document" in shown, command
    assert "--out" in runner.invoke(app, ["ab", "--help"], env={"COLUMNS": "200"}).stdout


def test_trust_options_are_options_and_environment_variables():
    for command in ("deposit", "ask", "explain", "ab", "calibrate", "demo", "gc"):
        shown = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).stdout
        for option in ("--namespace", "--signing-key-file", "--deadline", "--threads"):
            assert option in shown, (command, option)
    assert "KVRAG_SIGNING_KEY_FILE" in runner.invoke(app, ["ask", "--help"], env={"COLUMNS": "200"}).stdout


def test_ask_deposits_unless_told_not_to_and_keys_and_namespaces_separate_states(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC_A)
    key = tmp_path / "fleet.key"
    key.write_text("a fleet secret\n")
    common = ["--doc", str(doc), "--model", "tiny-random-llama", "--store", f"disk://{tmp_path / 'states'}",
              "--max-tokens", "2", "--json", "--signing-key-file", str(key)]

    def mode(*extra: str) -> str:
        asked = runner.invoke(app, ["ask", "Who built it?", *common, *extra])
        assert asked.exit_code == 0, asked.output
        return json.loads(asked.stdout)["receipt"]["mode"]

    assert mode("--no-deposit") == "text-prefill"
    assert mode("--no-deposit") == "text-prefill"  # nothing was deposited
    assert mode() == "text-prefill"  # reads, then deposits
    assert mode() == "exact-graft"
    assert mode("--namespace", "acme") == "text-prefill"  # another tenant's key addresses other states
    other = tmp_path / "other.key"
    other.write_text("another secret\n")
    assert mode("--signing-key-file", str(other)) == "text-prefill"
    missing = runner.invoke(app, ["ask", "Who?", *common[:-2], "--signing-key-file", str(tmp_path / "none.key")])
    assert missing.exit_code == 2 and "signing key file" in missing.output


@pytest.mark.parametrize("kind", ["redis", "tiered", "cluster"])
def test_a_store_down_at_start_answers_by_text_with_one_warning(tmp_path, kind):
    from kvrag.testing import free_port

    doc = tmp_path / "doc.txt"
    doc.write_text(DOC_A)
    down = {"redis": f"redis://127.0.0.1:{free_port()}/0",
            "tiered": f"redis://127.0.0.1:{free_port()}/0,disk://{tmp_path / 'states'}",
            "cluster": f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"}[kind]
    done = subprocess.run([sys.executable, "-m", "kvrag.cli", "ask", "Who built it?", "--doc", str(doc), "--model",
                           "tiny-random-llama", "--store", down, "--max-tokens", "2"],
                          capture_output=True, text=True, timeout=300, env={**__import__("os").environ,
                                                                            "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert "text-prefill" in done.stdout + done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("kvrag: warning:")]
    # memo, prefix records, the answer's read and the deposit after it all meet one outage: one line
    assert len(warnings) == 1, done.stderr
    assert warnings[0].startswith(f"kvrag: warning: {down.split(',disk')[0]} is unavailable")
    assert "read as text" in warnings[0] and "Traceback" not in done.stderr
