"""`kvrag serve` under load answers as it answers alone: a real server (batching on, the hot
memory tier in front of a real Redis, deposits in the background) with several tenants, hit by
many clients at once with cold and warm asks of shared documents, some clients going away
mid-answer; then every request again, alone. Every answer's first-token logits SHA-256 and text
must equal its solo answer's. (The long form, thousands of answers over every tiny family and
smollm2-135m: `benchmarks/under_load.py`.)"""

from __future__ import annotations

import uuid

import pytest

from kvrag.testing import KVRagServer, Request, answers_under_load
from tests.conftest import DOC_A, DOC_B, DOC_C

QUESTIONS = ["Who built the lighthouse?", "When was the lamp electrified?", "What is kept in the lantern room?"]


def workload(keys: list[str], per_tenant: int, documents: list[str] | None = None) -> list[Request]:
    """Each tenant asks about documents new to the store, each pair twice (cold, then warm, often
    at once), in an order interleaved with the other tenants'; every fifth client goes away."""
    case = uuid.uuid4().hex[:8]
    base = documents or [DOC_A, DOC_B, DOC_C, DOC_A + " " + DOC_B]
    docs = [f"{doc} (Case {case}-{i}.)" for i, doc in enumerate(base)]
    requests = []
    for i in range(per_tenant):
        for key in keys:
            pair = (docs[i // 2 % len(docs)], docs[(i // 2 + 1) % len(docs)])[: 1 + i // 2 % 2]
            requests.append(Request(QUESTIONS[i % len(QUESTIONS)], pair, key, max_tokens=6 + i % 5,
                                    leave_after=2 if len(requests) % 5 == 4 else None))
    return requests


@pytest.mark.parametrize("model, dtype", [("tiny-random-llama", "float32"), ("tiny-random-qwen2", "bfloat16")])
def test_every_answer_under_load_equals_the_same_request_alone(redis_server, tmp_path, model, dtype):
    keys = [f"key-of-load-tenant-{i}-0123456789" for i in range(3)]
    (tmp_path / "keys.txt").write_text("".join(f"{key} tenant-{i}\n" for i, key in enumerate(keys)))
    server = KVRagServer(model, redis_server.url, ("--api-key-file", str(tmp_path / "keys.txt"), "--dtype", dtype,
                                                   "--concurrency", "8", "--queue", "64"),
                         log=tmp_path / "serve.log", api_key=keys[0]).start()
    try:
        requests = workload(keys, per_tenant=12)
        report = answers_under_load(server, requests, clients=8, model=model)
    finally:
        server.stop(kill=True)
    assert report.failed == [] and report.unlike == [], report
    assert report.answered + report.left == len(requests) and report.left >= len(requests) // 5, report
    assert report.modes.get("exact-graft", 0) + report.modes.get("partial-graft", 0) > 0, report  # warm ones grafted
    assert "kvrag: error" not in (tmp_path / "serve.log").read_text()
