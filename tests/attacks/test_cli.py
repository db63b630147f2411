"""Bad input at the command line: one line on stderr, exit status 2, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

KEY = "ab" * 32


def _run(*args, timeout=120):
    began = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "kvrag.cli", *args], capture_output=True, text=True, timeout=timeout,
                            env={**__import__("os").environ, "COLUMNS": "80"})
    return result, time.monotonic() - began


def _one_line_error(result):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr


def test_a_file_that_is_not_utf8(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    for args in (["deposit", str(bad)], ["ask", "Why?", "--doc", str(bad)]):
        _one_line_error(_run(*args, "--model", "tiny-random-llama", "--store", "memory://")[0])


@pytest.mark.parametrize("url", ["redis://localhost:notaport/0", "redis://127.0.0.1:6379/0?frame_mib=2048",
                                 "redis://127.0.0.1:6379/0?frame_mib=inf", "redis://127.0.0.1:6379/0?frame_mib=nan",
                                 "redis://127.0.0.1:6379/0?prefix=kv*", "redis+cluster://a:1,b:x", "nope://x",
                                 "redis://127.0.0.1:6379/0?namespace=a/b"])
def test_bad_store_urls(url):
    _one_line_error(_run("ls", "--store", url)[0])


def test_a_directory_named_like_a_state(tmp_path):
    """Skipped with one clear line by ls and gc (never deleted as a state, never a traceback);
    refused with one line by inspect."""
    planted = tmp_path / "states" / KEY[:2] / f"{KEY}.kvstate"
    planted.mkdir(parents=True)
    store = f"disk://{tmp_path}"
    for args in (["ls", "--json"], ["gc", "--store", store, "--model", "tiny-random-llama"]):
        result, _ = _run(*args, *(["--store", store] if args[0] == "ls" else []))
        assert result.returncode == 0, result.stderr[-2000:]
        assert "Traceback" not in result.stderr + result.stdout
        skipped = [line for line in result.stderr.splitlines() if "not a state file" in line]
        assert len(skipped) == 1 and KEY[:12] in skipped[0], result.stderr
    assert planted.is_dir()
    assert json.loads(_run("ls", "--json", "--store", store)[0].stdout) == []
    inspected, _ = _run("inspect", KEY, "--store", store)
    _one_line_error(inspected)
    assert "not a regular file" in inspected.stderr


def test_a_long_bad_key_is_shortened():
    result, _ = _run("inspect", "x" * 5000, "--store", "memory://")
    _one_line_error(result)
    assert len(result.stderr) < 300


def test_a_huge_input_file_is_refused_before_tokenizing(tmp_path):
    huge = tmp_path / "huge.txt"
    huge.write_text("word " * 4_000_000)  # 20 MB
    result, took = _run("deposit", str(huge), "--model", "tiny-random-llama", "--store", "memory://")
    _one_line_error(result)
    assert "characters" in result.stderr and took < 60
