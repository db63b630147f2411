"""Shared parts of the connector's tests: the real smollm2-135m model folder, a throwaway Redis, and
vLLM runs in child processes (each one a fresh engine: a restart)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RUNNER = Path(__file__).with_name("runner.py")
#: the project's environment, which converts the embedded model into a folder vLLM reads
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "TOKENIZERS_PARALLELISM": "false"}
_STEP = re.compile(r"KVRAG-TEST-STEP (\S+)")


@dataclass
class Run:
    """A vLLM run's answers by request name, and the connector's log lines by request name."""

    answers: dict[str, dict]
    logs: dict[str, list[str]]

    def loaded(self, name: str) -> int:
        """Blocks the connector loaded for a request (from its log line)."""
        total = 0
        for line in self.logs[name]:
            found = re.search(r"kvrag: request \S+: loaded (\d+) (?:of \d+ )?blocks", line)
            total += int(found.group(1)) if found else 0
        return total

    def refused(self, name: str) -> list[str]:
        return [m.group(1) for line in self.logs[name] for m in [re.search(r"refused \((\w+)\)", line)] if m]


@pytest.fixture(scope="session")
def model_folder() -> str:
    code = ("from kvrag.models.loading import GGUF_MODELS, embedded_folder; "
            "print(embedded_folder(GGUF_MODELS['smollm2-135m']))")
    python = str(MAIN_PYTHON if MAIN_PYTHON.exists() else sys.executable)
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    from kvrag.testing import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


def run_vllm(tmp: Path, spec: dict) -> Run:
    """One vLLM engine in a child process over `spec`'s requests (see runner.py)."""
    spec_path, out_path = tmp / "spec.json", tmp / "out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, **VLLM_ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "integrations" / "vllm-kvrag")])}
    # vLLM logs to stdout, the runner marks its steps on stderr: one stream keeps their order
    done = subprocess.run([sys.executable, str(RUNNER), str(spec_path), str(out_path)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise AssertionError(f"vLLM run failed ({done.returncode}):\n{done.stdout[-4000:]}")
    logs: dict[str, list[str]] = defaultdict(list)
    step = None
    for line in done.stdout.splitlines():
        found = _STEP.search(line)
        if found:
            step = found.group(1)
        elif step and "kvrag:" in line:
            logs[step].append(line)
    return Run({a["name"]: a for a in json.loads(out_path.read_text())}, logs)
