"""vLLM-CPU with kvrag's connector: time to first token, and what a hit's bits equal.

Runs in vLLM's environment (`make vllm-env`): `.venv-peer/bin/python benchmarks/vllm_connector.py`.
Each arm is a vLLM engine of its own, in a child process, alone; the model is smollm2-135m (the
folder kvrag converts its embedded GGUF into).

TTFT (`--sizes`, float32): for prompts of about 500, 1,500 and 4,000 tokens (a record number, then
documents; a new record number per call, so each call is new to every cache), the median wall time
of one call producing one token:

- vLLM cold: no connector, nothing cached;
- vLLM warm: the same prompt again (vLLM's own prefix cache holds its full blocks);
- connector hit from memory, disk or Redis: the same prompt after `reset_prefix_cache()`, its
  full blocks loaded from that kvrag store through kvrag's checks, beside that process's own warm
  hit (the memory store's arm runs vLLM's worker in-process, `distributed_executor_backend="uni"`
  and `VLLM_ENABLE_V1_MULTIPROCESSING=0`: the only way its scheduler and worker share the store).

Equality (`--dtypes`): over held-out prompts (the sample documents, alone, in pairs and in runs of
four to eight, with a question; 16 greedy tokens, the first token's top-20 logprobs), (a) cold, (b)
warm in vLLM's prefix cache, (c) after a restart, loaded from a kvrag disk store: how often (b) and
(c) equal (a), and (c) equals (b).

    .venv-peer/bin/python benchmarks/vllm_connector.py --json benchmarks/results/vllm_connector.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "TOKENIZERS_PARALLELISM": "false"}
QUESTIONS = ["Who is named first in the text?", "What year is mentioned first?", "Summarize it in one sentence.",
             "What place does it describe?", "What changed over time?", "Who did the work?",
             "What is measured, and how?", "What went wrong?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="500,1500,4000", help="prompt sizes in tokens for the TTFT table")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per arm and size (the median is shown)")
    parser.add_argument("--ttft-dtype", default="float32", help="the dtype of the TTFT table")
    parser.add_argument("--arms", default="none,memory,disk,redis",
                        help="the TTFT table's arms: none (vLLM alone), memory, disk, redis")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="dtypes of the equality table")
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--skip-equality", action="store_true")
    parser.add_argument("--json", dest="json_path", default="benchmarks/results/vllm_connector.json")
    parser.add_argument("--print", dest="print_path", help="print the tables of an earlier run's JSON")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    if args.print_path:
        report = json.loads(Path(args.print_path).read_text())
        if "ttft" in report:
            print_ttft(report)
        if "equality" in report:
            print_equality(report)
        return None
    from kvrag.testing import RedisServer

    folder = model_folder()
    report: dict = {"model": "smollm2-135m", "cpu": _cpu(), "date": time.strftime("%Y-%m-%d"), "commit": _commit()}
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp) / "redis").start()
        try:
            if not args.skip_ttft:
                report["ttft"] = measure_ttft(Path(tmp), folder, [int(s) for s in args.sizes.split(",")], args.repeat,
                                              redis.url, args.ttft_dtype, args.arms.split(","))
                report["ttft_dtype"] = args.ttft_dtype
                print_ttft(report)
            if not args.skip_equality:
                report["equality"] = [measure_equality(Path(tmp), folder, dtype) for dtype in args.dtypes.split(",")]
                print_equality(report)
        finally:
            redis.stop()
    Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_path).write_text(json.dumps(report, indent=1))


def model_folder() -> str:
    """The smollm2-135m folder, converted by the project's own environment (it has the GGUF reader)."""
    python = ROOT / ".venv" / "bin" / "python"
    code = "from kvrag.models.loading import GGUF_MODELS, embedded_folder; print(embedded_folder(GGUF_MODELS['smollm2-135m']))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return out.stdout.strip().splitlines()[-1]


def run(tmp: Path, spec: dict) -> dict:
    """One vLLM engine in a child process; its result, and the blocks the connector loaded per step
    (from the connector's log lines, which follow the step's marker)."""
    spec_path, out_path = tmp / "spec.json", tmp / "out.json"
    spec_path.write_text(json.dumps(spec))
    # the memory store's arm keeps vLLM's worker in this process (the store is shared only there)
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if spec.get("uni") else {}
    done = subprocess.run([sys.executable, __file__, "--worker", str(spec_path), str(out_path)],
                          env={**os.environ, **VLLM_ENV, **in_process},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        raise SystemExit(f"vLLM run failed:\n{done.stdout[-3000:]}")
    loaded: dict[int, int] = {}
    step = None
    for line in done.stdout.splitlines():
        if line.startswith("KVRAG-STEP "):
            step = int(line.split()[1])
        elif step is not None and (found := re.search(r"kvrag: request \S+: loaded (\d+)", line)):
            loaded[step] = loaded.get(step, 0) + int(found.group(1))
    return {**json.loads(out_path.read_text()), "loaded": loaded}


def measure_ttft(tmp: Path, folder: str, sizes: list[int], repeat: int, redis_url: str, dtype: str = "float32",
                 arms: list[str] | None = None) -> dict:
    stores = {"none": None, "memory": "memory://", "disk": f"disk://{tmp / 'disk-ttft'}", "redis": redis_url}
    results = {}
    for arm in arms or list(stores):
        store = stores[arm]
        print(f"TTFT arm: {arm}", flush=True)
        results[arm] = run(tmp, {"mode": "ttft", "folder": folder, "dtype": dtype, "store": store, "sizes": sizes,
                                 "repeat": repeat, "uni": arm == "memory"})
    return results


def measure_equality(tmp: Path, folder: str, dtype: str) -> dict:
    store = f"disk://{tmp / ('disk-equality-' + dtype)}"
    print(f"equality: {dtype}", flush=True)
    first = run(tmp, {"mode": "answers", "folder": folder, "dtype": dtype, "store": store, "phase": "first"})
    restart = run(tmp, {"mode": "answers", "folder": folder, "dtype": dtype, "store": store, "phase": "restart"})
    rows = []
    for index, ((cold, warm), hit) in enumerate(zip(first["answers"], restart["answers"])):
        rows.append({"prompt_tokens": cold["prompt_tokens"], "loaded_blocks": restart["loaded"].get(index, 0),
                     "warm_logprobs": warm["sha"] == cold["sha"], "warm_text": warm["tokens"] == cold["tokens"],
                     "hit_logprobs": hit["sha"] == cold["sha"], "hit_text": hit["tokens"] == cold["tokens"],
                     "hit_vs_warm_logprobs": hit["sha"] == warm["sha"], "hit_vs_warm_text": hit["tokens"] == warm["tokens"],
                     "max_abs_logprob_diff_warm": _diff(cold, warm), "max_abs_logprob_diff_hit": _diff(cold, hit)})
    return {"dtype": dtype, "rows": rows}


def _diff(a: dict, b: dict) -> float:
    left, right = dict(map(tuple, a["top"])), dict(map(tuple, b["top"]))
    shared = set(left) & set(right)
    return max((abs(left[t] - right[t]) for t in shared), default=float("nan"))


# ---- in vLLM's environment -----------------------------------------------------------------

def worker(spec_path: str, out_path: str) -> None:
    from vllm import LLM

    spec = json.loads(Path(spec_path).read_text())
    kwargs: dict = {}
    if spec.get("store"):
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVRagConnector", "kv_connector_module_path": "vllm_kvrag.connector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"store": spec["store"]}}
    if spec.get("uni"):
        kwargs["distributed_executor_backend"] = "uni"
    llm = LLM(model=spec["folder"], dtype=spec["dtype"], enable_prefix_caching=True, max_model_len=4608, seed=0,
              **kwargs)
    result = ttft_worker(llm, spec) if spec["mode"] == "ttft" else answers_worker(llm, spec)
    Path(out_path).write_text(json.dumps(result))


def _documents(tokenizer, size: int, record: int) -> list[int]:
    from kvrag.data import sample_docs

    text = "\n\n".join(d.text for d in sample_docs())
    ids = tokenizer.encode(f"Record {record}.\n\n")
    body = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < size:
        ids += body[: size - len(ids)]
    return ids[:size]


def ttft_worker(llm, spec: dict) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    tokenizer = llm.get_tokenizer()

    def call(ids: list[int]) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return (time.perf_counter() - start) * 1e3

    call(_documents(tokenizer, 600, 10_000))  # warm the code paths
    rows = []
    for size in spec["sizes"]:
        cold, warm, hit = [], [], []
        for r in range(spec["repeat"]):
            ids = _documents(tokenizer, size, size * 100 + r)
            cold.append(call(ids))
            warm.append(call(ids))
            if spec.get("store"):
                llm.reset_prefix_cache()
                hit.append(call(ids))
        rows.append({"size": size, "cold": statistics.median(cold), "warm": statistics.median(warm),
                     "hit": statistics.median(hit) if hit else None, "raw": {"cold": cold, "warm": warm, "hit": hit}})
    return {"rows": rows}


def _answer(llm, prompt: str) -> dict:
    from vllm import SamplingParams

    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, logprobs=20), use_tqdm=False)[0]
    answer = out.outputs[0]
    top = sorted((int(t), float(lp.logprob)) for t, lp in answer.logprobs[0].items())
    sha = hashlib.sha256(b"".join(struct.pack("<qf", t, v) for t, v in top)).hexdigest()
    return {"prompt_tokens": len(out.prompt_token_ids), "tokens": list(answer.token_ids), "sha": sha, "top": top}


def held_out_prompts() -> list[str]:
    """Each sample document alone and with the next (about 200-500 tokens), then runs of four to all
    eight documents from each one (about 1,000-2,300 tokens), each with a question."""
    from kvrag.data import sample_docs

    docs = sample_docs()
    prompts = []
    for i in range(len(docs)):
        for count in (1, 2, 4 + i % 5):
            run = [docs[(i + k) % len(docs)] for k in range(count)]
            question = QUESTIONS[(i + count) % len(QUESTIONS)]
            prompts.append("\n\n".join(d.text for d in run) + f"\n\nQuestion: {question}\nAnswer:")
    return prompts


def answers_worker(llm, spec: dict) -> dict:
    answers = []
    for index, prompt in enumerate(held_out_prompts()):
        print(f"KVRAG-STEP {index}", flush=True)
        if spec["phase"] == "first":
            answers.append((_answer(llm, prompt), _answer(llm, prompt)))
        else:
            answers.append(_answer(llm, prompt))
    return {"answers": answers}


# ---- tables ----------------------------------------------------------------------------------

def print_ttft(report: dict) -> None:
    ttft = report["ttft"]
    print(f"\nTTFT, smollm2-135m {report.get('ttft_dtype', 'float32')}, vLLM-CPU 0.32, {report['cpu']['model']} ({' '.join(report['cpu']['extensions'])}),"
          f" median of the calls, one run; each hit beside the warm hit of its own process\n")
    print("| prompt tokens | vLLM cold | vLLM warm | hit, memory (its warm) | vs warm | hit, disk (its warm) | vs warm "
          "| hit, Redis (its warm) | vs warm |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    first = next(iter(ttft.values()))
    for index, row in enumerate(first["rows"]):
        plain = ttft["none"]["rows"][index] if "none" in ttft else None
        cells = [f"{row['size']:,}", *(f"{plain[k]:.0f} ms" if plain else "-" for k in ("cold", "warm"))]
        for arm in ("memory", "disk", "redis"):
            own = ttft[arm]["rows"][index] if arm in ttft else None
            cells += [f"{own['hit']:.0f} ms ({own['warm']:.0f} ms)", f"{own['hit'] / own['warm']:.2f}x"] if own else ["-", "-"]
        print("| " + " | ".join(cells) + " |")


def print_equality(report: dict) -> None:
    print("\n| dtype | prompt tokens | prompts | warm = cold (logprobs, text) | hit = cold (logprobs, text) "
          "| hit = warm (logprobs, text) | blocks loaded | largest logprob difference, hit vs cold |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for table in report["equality"]:
        for low, high in ((0, 1000), (1000, 1 << 20)):
            rows = [r for r in table["rows"] if low <= r["prompt_tokens"] < high]
            if not rows:
                continue
            n = len(rows)

            def count(key: str) -> str:
                return f"{sum(1 for r in rows if r[key])}/{n}"

            sizes = f"{min(r['prompt_tokens'] for r in rows):,}-{max(r['prompt_tokens'] for r in rows):,}"
            print(f"| {table['dtype']} | {sizes} | {n} | {count('warm_logprobs')}, {count('warm_text')} "
                  f"| {count('hit_logprobs')}, {count('hit_text')} | {count('hit_vs_warm_logprobs')}, "
                  f"{count('hit_vs_warm_text')} | {sum(r['loaded_blocks'] or 0 for r in rows)} "
                  f"| {max(r['max_abs_logprob_diff_hit'] for r in rows):.2g} |")


def _cpu() -> dict:
    flags: set[str] = set()
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
        if line.startswith("model name") and not model:
            model = line.split(":", 1)[1].strip()
    return {"model": model, "cores": os.cpu_count(), "extensions": sorted(f for f in flags if f.startswith(("avx", "amx")))}


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return out.stdout.strip()


if __name__ == "__main__":
    main()
