"""Every code block of the README, the quickstart and the guides runs, offline, as a user pastes it.

A page runs top to bottom in a fresh folder, each block in a fresh process: Python blocks with the
project's interpreter (forked from one that has imported torch, transformers and kvrag and done
nothing else: `warm_python.py`), shell blocks line by line. A throwaway Redis stands in for the one at
127.0.0.1:6379, and a free port for a server's 8000. Three kinds of shell line are checked rather
than run: `make <target>` (the target exists; `make test` is what runs this), `pip install ...` (the
local paths exist; this environment already has them), and vLLM's server with the kvrag connector
(it runs in vLLM's environment, where `integrations/vllm-kvrag`'s tests start it: here its
connector, module and settings keys exist). A line ending in `&` runs
in the background until the page ends; a `kvrag serve` there is waited for until it is healthy.
`text` blocks are program output, not code. Every other page's blocks are checked too: only
commands of scripts and subcommands that exist.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvrag.testing import RedisServer, free_port

ROOT = Path(__file__).parents[2]
BIN = Path(sys.executable).parent
RUN = [ROOT / "README.md", ROOT / "docs" / "quickstart.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
CHECKED = [p for p in sorted((ROOT / "docs").rglob("*.md")) if p not in RUN]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
MAKE_TARGETS = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
RAN: list[str] = []


SNIPPET = re.compile(r'^--8<-- "([^":]+)(?::(\d+):(\d+))?"$', re.M)


def _snippet(found: re.Match) -> str:
    """A `--8<-- "path:first:last"` line as mkdocs renders it: those lines of that file."""
    lines = (ROOT / found[1]).read_text().splitlines()
    first, last = (int(found[2]), int(found[3])) if found[2] else (1, len(lines))
    return "\n".join(lines[first - 1 : last])


def blocks(page: Path) -> list[tuple[str, str]]:
    return [(lang, SNIPPET.sub(_snippet, code)) for lang, code in FENCE.findall(page.read_text())]


def _lines(code: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def _wait_healthy(port: int, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not become healthy")


@pytest.fixture(scope="module")
def python():
    """Runs a Python block in a fresh process forked from a warm interpreter: (status, stdout, stderr)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    warm = subprocess.Popen([sys.executable, str(Path(__file__).with_name("warm_python.py"))], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)

    def run(code: str, cwd: Path, block_env: dict) -> tuple[int, str, str]:
        assert warm.stdin is not None and warm.stdout is not None
        warm.stdin.write(json.dumps({"code": code, "cwd": str(cwd), "env": block_env}) + "\n")
        warm.stdin.flush()
        answer = json.loads(warm.stdout.readline())
        return answer["status"], answer["stdout"], answer["stderr"]

    yield run
    warm.stdin.close()  # type: ignore[union-attr]
    warm.wait(timeout=60)


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("docs-redis")).start()
    yield server
    server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_of_the_page_runs(page: Path, redis, python, tmp_path):
    found = blocks(page)
    assert found, f"{page} has no code block"
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "NO_COLOR": "1", "PYTHONWARNINGS": "ignore"}
    background: list[subprocess.Popen] = []

    def localize(code: str) -> str:
        return code.replace("127.0.0.1:6379", f"127.0.0.1:{redis.port}").replace("8000", str(port))

    try:
        for index, (lang, code) in enumerate(found):
            where = f"{page.relative_to(ROOT)} block {index + 1} ({lang})"
            code = localize(code)
            if lang == "python":
                status, stdout, stderr = python(code, tmp_path, env)
                assert status == 0, f"{where} failed:\n{stdout[-2000:]}\n{stderr[-3000:]}"
            elif lang == "bash":
                for line in _lines(code):
                    _run_line(line, where, tmp_path, env, background, port)
            else:
                assert lang == "text", f"{where}: a block must be python, bash or text (output), not {lang!r}"
                continue
            RAN.append(where)
    finally:
        for process in background:  # the whole session: a shell, its command, a server's workers
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
    print(f"{page.relative_to(ROOT)}: ran {sum(1 for r in RAN if r.startswith(str(page.relative_to(ROOT))))} "
          f"of {sum(1 for lang, _ in found if lang != 'text')} code blocks")


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


def _run_line(line: str, where: str, cwd: Path, env: dict, background: list, port: int) -> None:
    words = shlex.split(line.split(" #")[0])
    if words[0] == "make":
        assert words[1] in MAKE_TARGETS, f"{where}: no make target {words[1]}"
        return
    if words[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]:
        _check_vllm_server(words, where)
        return
    if words[:2] == ["pip", "install"]:
        for word in words[2:]:
            if word.startswith((".", "/")):
                assert (ROOT / word).exists(), f"{where}: {word} does not exist"
        return
    if line.endswith("&"):
        process = subprocess.Popen(line[:-1], shell=True, cwd=cwd, env=env, start_new_session=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        background.append(process)
        if words[:2] == ["kvrag", "serve"]:
            _wait_healthy(port, process)
        return
    done = subprocess.run(line, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{where}: `{line}` failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def _check_vllm_server(words: list[str], where: str) -> None:
    """vLLM's server line names the kvrag connector as it is: its module and class, its settings' keys."""
    config = json.loads(words[words.index("--kv-transfer-config") + 1])
    module = ROOT / "integrations" / "vllm-kvrag" / Path(*config["kv_connector_module_path"].split(".")).with_suffix(".py")
    assert module.exists() and f"class {config['kv_connector']}(" in module.read_text(), f"{where}: no such connector"
    assert config["kv_load_failure_policy"] == "recompute", f"{where}: the connector needs recompute"
    settings = (ROOT / "integrations" / "vllm-kvrag" / "vllm_kvrag" / "settings.py").read_text()
    keys = re.search(r"KEYS = \(([^)]*)\)", settings).group(1)
    unknown = set(config["kv_connector_extra_config"]) - set(re.findall(r'"(\w+)"', keys))
    assert not unknown, f"{where}: the connector has no settings {sorted(unknown)}"


@pytest.mark.parametrize("page", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_other_pages_hold_only_output_and_commands_that_exist(page: Path):
    from typer.testing import CliRunner

    from kvrag.cli import app

    for lang, code in blocks(page):
        if lang in ("text", "mermaid"):  # program output, a diagram
            continue
        assert lang == "bash", f"{page}: a {lang!r} block outside the README, quickstart and guides"
        for line in _lines(code):
            words = shlex.split(line.split(" #")[0])
            words = words[1:] if words[0].endswith("python") else words
            program = words[0].replace(".venv/bin/", "")
            if program == "kvrag":
                assert CliRunner().invoke(app, [words[1], "--help"]).exit_code == 0, line
            else:
                assert (ROOT / program).exists(), f"{page}: {program} does not exist"


def test_the_readme_is_short_and_its_figures_are_on_benchmark_pages():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    rows = [line for line in readme.splitlines() if line.startswith("| ") and "](docs/benchmarks/" in line]
    assert rows, "the README's figures table"
    for row in rows:
        figure = row.split("|")[2].strip()
        page = ROOT / re.search(r"\]\((docs/benchmarks/[\w.-]+)\)", row).group(1)
        number = re.search(r"[\d.,/]+x?", figure).group(0)
        assert number in page.read_text(), f"{number} ({figure}) is not on {page}"


def test_every_environment_variable_the_code_reads_is_documented():
    table = (ROOT / "docs" / "reference" / "environment.md").read_text()
    code = " ".join(p.read_text() for p in (ROOT / "kvrag").rglob("*.py"))
    for name in set(re.findall(r"\bKVRAG_[A-Z_]+[A-Z]\b", code)):
        assert f"`{name}`" in table, f"{name} is read by kvrag but not in docs/reference/environment.md"
