"""kvrag beside its peer: vLLM's CPU build with automatic prefix caching, same model, same prompts.

For each dtype (float32, bfloat16) and prompt of about 500, 1,500 and 4,000 tokens (a document,
then a question, in smollm2-135m's chat template), one run prints the median TTFT (wall time of one
call producing one token) of:

- vLLM cold: the prefix cache reset before each call;
- vLLM warm: a new question over a document already in its prefix cache;
- kvrag text: the whole prompt read as text;
- kvrag graft from memory: the document's state from the memory store, then the question;
- kvrag graft from Redis: the state deposited by another process into a redis-server (a third
  process), read over loopback and checked, then the question.

Every arm gets the same token ids (kvrag renders them; vLLM takes them as `prompt_token_ids`),
each question new to every arm (kvrag's memo off), and the same model folder (the one kvrag
converts the embedded GGUF into). vLLM runs in its own environment (`make peer-env`), as a child
process, alone: nothing else runs while an arm is timed.

    make peer                                             # sets up .venv-peer, then this
    python benchmarks/peer_vllm.py --peer-python .venv-peer/bin/python --json out.json
    python benchmarks/peer_vllm.py --skip-vllm            # kvrag's arms only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "smollm2-135m"
QUESTIONS = [
    "According to the document, who built the lighthouse at Varrow Point, and when?",
    "What does the document say about the keeper's logbook?",
    "Which storm is mentioned in the document, and what did it damage?",
    "Summarize the document in one sentence.",
    "What is the first place named in the document?",
    "Who wrote the letters the document mentions?",
    "How many years does the document cover?",
]
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "TOKENIZERS_PARALLELISM": "false"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="500,1500,4000", help="document sizes in tokens")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per arm (the median is shown)")
    parser.add_argument("--peer-python", default=".venv-peer/bin/python", help="the vLLM environment's python")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--json", dest="json_path", default="benchmarks/results/peer_vllm.json")
    parser.add_argument("--vllm-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--deposit-worker", nargs=3, metavar=("STORE", "DTYPE", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_worker:
        return vllm_worker(*args.vllm_worker)
    if args.deposit_worker:
        return deposit_worker(*args.deposit_worker)

    sizes = [int(s) for s in args.sizes.split(",")]
    questions = QUESTIONS[: args.repeat + 1]
    results = []
    for dtype in args.dtypes.split(","):
        rows = measure_kvrag(dtype, sizes, questions)
        if not args.skip_vllm:
            vllm = measure_vllm(args.peer_python, dtype, rows, questions)
            for row, peer in zip(rows, vllm):
                row.update(peer)
        results.append({"dtype": dtype, "rows": rows})
        print_table(dtype, rows, args.repeat)
    for result in results:
        for row in result["rows"]:
            row.pop("prompts")
    Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json_path, "w") as f:
        json.dump({"model": MODEL, "repeat": args.repeat, "threads": _threads(), "cpu": _cpu(), "results": results}, f,
                  indent=2)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _cpu() -> dict:
    """What the figures depend on most: the CPU's vector extensions (vLLM's and oneDNN's fast paths
    need AVX512; torch's capability says which kernels it picked)."""
    import torch

    flags: set[str] = set()
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"model": model, "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "extensions": sorted(f for f in flags if f.startswith(("avx", "amx")))}


def measure_kvrag(dtype: str, sizes: list[int], questions: list[str]) -> list[dict]:
    from kvrag import KVEngine, MemoryStore, load_model
    from kvrag.data import long_document
    from kvrag.stores import open_store
    from kvrag.testing import RedisServer

    model = load_model(MODEL, dtype=dtype)
    memory = KVEngine(model, MemoryStore())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            redis = KVEngine(model, open_store(server.url))
            for size in sizes:
                document = long_document(model.tokenizer, size)
                ref = memory.deposit(document)
                # another process deposits the same document into Redis; this one only reads it
                subprocess.run([sys.executable, __file__, "--deposit-worker", server.url, dtype, str(size)], check=True,
                               stdout=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
                segments = memory.plan([document])
                prompts = [[i for s in segments for i in s.ids] + memory.planner.question(q, segments) for q in questions]
                row = {"document_tokens": ref.token_count, "prompt_tokens": [len(p) for p in prompts],
                       "prompts": prompts, "folder": str(model_folder())}
                timed: dict[str, list[float]] = {"kvrag_text": [], "kvrag_memory": [], "kvrag_redis": []}
                shas: set[str] = set()
                # warm each engine's code paths and buffers with a question no timed call asks, as vLLM's
                # arms are warmed: a process's first read maps fresh pages, later ones reuse them
                for engine in (memory, redis):
                    engine.generate(questions[0], states=[ref], max_new_tokens=1, memo=False)
                for question in questions[1:]:
                    for arm, engine, graft, mode in (("kvrag_text", memory, False, "text-prefill"),
                                                     ("kvrag_memory", memory, True, "exact-graft"),
                                                     ("kvrag_redis", redis, True, "exact-graft")):
                        start = time.perf_counter()
                        generation = engine.generate(question, states=[ref], max_new_tokens=1, graft=graft, memo=False)
                        timed[arm].append((time.perf_counter() - start) * 1e3)
                        assert generation.receipt.mode == mode, (arm, generation.receipt)
                        shas.add((question, generation.receipt.first_token_logits_sha256))
                row.update({arm: round(statistics.median(v), 1) for arm, v in timed.items()})
                row["kvrag_same_logits"] = len(shas) == len(questions) - 1  # one hash per question across arms
                rows.append(row)
                print(f"kvrag {dtype} {ref.token_count} tokens: " + ", ".join(f"{a} {row[a]:.0f} ms" for a in timed),
                      flush=True)
        finally:
            server.stop()
    return rows


def deposit_worker(store_url: str, dtype: str, size: str) -> None:
    from kvrag import KVEngine, load_model
    from kvrag.data import long_document
    from kvrag.stores import open_store

    model = load_model(MODEL, dtype=dtype)
    KVEngine(model, open_store(store_url)).deposit(long_document(model.tokenizer, int(size)))


def model_folder() -> Path:
    from kvrag.models.loading import GGUF_MODELS, embedded_folder

    return embedded_folder(GGUF_MODELS[MODEL])


def measure_vllm(peer_python: str, dtype: str, rows: list[dict], questions: list[str]) -> list[dict]:
    if not Path(peer_python).exists():
        raise SystemExit(f"{peer_python} not found: run `make peer-env` first (or pass --skip-vllm)")
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"folder": rows[0]["folder"], "dtype": dtype,
                                    "prompts": [row["prompts"] for row in rows]}))
        subprocess.run([peer_python, __file__, "--vllm-worker", str(spec), str(out)], check=True,
                       env={**os.environ, **VLLM_ENV})
        return json.loads(out.read_text())


def vllm_worker(spec_path: str, out_path: str) -> None:
    """Runs in the vLLM environment: cold and warm TTFT for each prompt set."""
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=spec["folder"], dtype=spec["dtype"], enable_prefix_caching=True, max_model_len=4096, seed=0)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def call(ids: list[int]) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return (time.perf_counter() - start) * 1e3

    call(spec["prompts"][0][0])  # warm the code paths
    results = []
    for prompts in spec["prompts"]:
        cold, warm = [], []
        for ids in prompts[1:]:
            llm.reset_prefix_cache()
            cold.append(call(ids))
        call(prompts[0])  # the document now cached, under a question asked before
        for ids in prompts[1:]:
            warm.append(call(ids))  # a new question over the cached document
        results.append({"vllm_cold": round(statistics.median(cold), 1), "vllm_warm": round(statistics.median(warm), 1)})
        print(f"vllm {spec['dtype']} {len(prompts[1])} tokens: cold {results[-1]['vllm_cold']:.0f} ms, "
              f"warm {results[-1]['vllm_warm']:.0f} ms", flush=True)
    Path(out_path).write_text(json.dumps(results))


def print_table(dtype: str, rows: list[dict], repeat: int) -> None:
    cpu = _cpu()
    print(f"\nTTFT, {MODEL}, {dtype}, CPU ({cpu['model']}, {' '.join(cpu['extensions'])}), median of {repeat} calls "
          "per arm, one run\n")
    print("| prompt tokens | vLLM cold | vLLM warm (prefix hit) | kvrag text | kvrag graft, memory | vs vLLM warm "
          "| kvrag graft, Redis (other process) | vs vLLM warm |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        warm = r.get("vllm_warm")
        ratio = (lambda v: f"{v / warm:.2f}x") if warm else (lambda v: "-")
        print(f"| {r['prompt_tokens'][1]:,} | {_ms(r.get('vllm_cold'))} | {_ms(warm)} | {_ms(r['kvrag_text'])} "
              f"| {_ms(r['kvrag_memory'])} | {ratio(r['kvrag_memory'])} | {_ms(r['kvrag_redis'])} | "
              f"{ratio(r['kvrag_redis'])} |")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


if __name__ == "__main__":
    main()
