"""States a fleet can share: under the invariant kernel a state deposited by a process with 2 torch
threads grafts in a process with 1 (OMP_NUM_THREADS=1), as separate `kvrag` processes; under sdpa,
whose bits depend on the thread count, the same ask reads the text, and both its receipt and
`kvrag explain` name the thread count as what differs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ..conftest import DOC_A, QUESTION


def _kvrag(*args: str, threads: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "kvrag.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def _common(tmp_path, attn: str) -> tuple[str, ...]:
    return ("--model", "tiny-random-llama", "--attn", attn, "--store", f"disk://{tmp_path / 'store'}")


def _deposit_then_ask(tmp_path, attn: str) -> tuple[dict, dict]:
    """Deposit with 2 threads, then ask in a process with 1 and in one with 2: their receipts."""
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC_A)
    common = _common(tmp_path, attn)
    deposited = _kvrag("deposit", str(doc), *common, "--json", threads=2)
    assert deposited.returncode == 0, deposited.stderr[-2000:]
    receipts = []
    for threads in (1, 2):
        asked = _kvrag("ask", QUESTION, "--doc", str(doc), *common, "--json", "--max-tokens", "2", "--no-deposit",
                       threads=threads)
        assert asked.returncode == 0, asked.stderr[-2000:]
        receipts.append(json.loads(asked.stdout)["receipt"])
    return receipts[0], receipts[1]


def test_under_the_invariant_kernel_a_state_made_with_2_threads_grafts_with_1(tmp_path):
    one, two = _deposit_then_ask(tmp_path, "invariant")
    assert one["mode"] == two["mode"] == "exact-graft"
    assert one["first_token_logits_sha256"] == two["first_token_logits_sha256"]
    assert one["hardware_fingerprint"] == two["hardware_fingerprint"]


def test_under_sdpa_a_state_made_with_2_threads_is_read_as_text_with_1(tmp_path):
    one, two = _deposit_then_ask(tmp_path, "sdpa")
    assert one["mode"] == "text-prefill" and one["states"][0]["reason"] == "missing"  # keyed for 2 threads
    assert two["mode"] == "exact-graft"
    assert one["hardware_fingerprint"] != two["hardware_fingerprint"]


def test_under_sdpa_the_receipt_and_kvrag_explain_name_the_thread_count(tmp_path):
    one, _ = _deposit_then_ask(tmp_path, "sdpa")
    assert "hardware.num_threads (2 stored, 1 here)" in one["states"][0]["detail"]
    explained = _kvrag("explain", "--doc", str(tmp_path / "doc.txt"), *_common(tmp_path, "sdpa"), "--json", threads=1)
    assert explained.returncode == 0, explained.stderr[-2000:]
    report = json.loads(explained.stdout)
    assert report["num_threads"] == 1
    (row,) = report["documents"]
    assert row["verdict"] == "reads text" and row["reason"].startswith("missing")
    (seen,) = row["elsewhere"]
    assert [d["field"] for d in seen["differences"]] == ["hardware.num_threads"]
    assert (seen["differences"][0]["stored"], seen["differences"][0]["needed"]) == ("2", "1")
    human = _kvrag("explain", "--doc", str(tmp_path / "doc.txt"), *_common(tmp_path, "sdpa"), threads=1)
    assert "hardware.num_threads: 2 stored, 1 here" in human.stdout
    grafts = _kvrag("explain", "--doc", str(tmp_path / "doc.txt"), *_common(tmp_path, "sdpa"), "--json", threads=2)
    assert json.loads(grafts.stdout)["documents"][0]["verdict"] == "grafts"
