"""Time per decoded token: kvrag's default kernel against `--attn sdpa` and a plain transformers
decoding loop, on the same model folder, in one process.

For each model, dtype, context size and row count: a document of about that many tokens (built
from the bundled text) is deposited, then `rows` generations graft it and decode --tokens greedy
tokens together (kvrag: through the batch, `kvrag.core.batching`, as `kvrag serve` runs them; the
plain loop: one batch of `rows` identical prompts over a `DynamicCache`). A step's time is the
decoding time of a generation divided by its steps (the median over generations and --repeat
runs); with several rows, a step advances every row by one token.

    python benchmarks/decode.py                                   # smollm2-135m, float32, all sizes
    python benchmarks/decode.py --models smollm2-135m,gemma3-270m --dtypes float32,bfloat16
    python benchmarks/decode.py --sizes 500 --rows 1,4 --json out.json

Ratios are what to compare: absolute times drift on shared machines.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time

import torch
from tqdm import tqdm
from transformers import DynamicCache

from kvrag import KVEngine, MemoryStore, load_model
from kvrag.core.batching import Batcher
from kvrag.data import long_document

QUESTION = "According to the document, who built the lighthouse at Varrow Point, and when?"
NEVER = "\x00never"  # a stop string no answer contains: every run decodes --tokens tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--sizes", default="500,1500,4000", help="context sizes in tokens")
    parser.add_argument("--rows", default="1,4,8,16", help="generations decoding together")
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per generation")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    cells = [(m, d, int(s), int(r)) for m in args.models.split(",") for d in args.dtypes.split(",")
             for s in args.sizes.split(",") for r in args.rows.split(",")]
    results = []
    engines: dict[tuple[str, str, str], KVEngine] = {}
    for model, dtype, size, rows in tqdm(cells, desc="decode", unit="cell"):
        row = {"model": model, "dtype": dtype, "context": size, "rows": rows}
        for attn in ("invariant", "sdpa"):
            key = (model, dtype, attn)
            if key not in engines:
                engines[key] = KVEngine(load_model(model, dtype=dtype, attn=attn), MemoryStore())
            row[attn] = kvrag_step_ms(engines[key], size, rows, args.tokens, args.repeat)
        row["plain"] = plain_step_ms(engines[(model, dtype, "sdpa")], size, rows, args.tokens, args.repeat)
        results.append(row)
    print(f"\nms per decoding step ({args.tokens} tokens, median of {args.repeat}); CPU: {cpu_name()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| model | dtype | context | rows | default kernel | `--attn sdpa` | plain transformers loop | default / plain |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['model']} | {r['dtype']} | {r['context']} | {r['rows']} | {r['invariant']:.1f} | {r['sdpa']:.1f} "
              f"| {r['plain']:.1f} | {r['invariant'] / r['plain']:.2f}x |")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"tokens": args.tokens, "repeat": args.repeat, "cpu": cpu_name(), "results": results}, f, indent=2)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def kvrag_step_ms(engine: KVEngine, size: int, rows: int, tokens: int, repeat: int) -> float:
    """`rows` generations over one grafted document, together through a batch (one alone: no batch)."""
    ref = engine.deposit(long_document(engine.model.tokenizer, size))
    steps: list[float] = []

    def answer() -> None:
        g = engine.generate(QUESTION, states=[ref], max_new_tokens=tokens, memo=False, stop=[NEVER])
        steps.append(g.receipt.timings.decode_ms / max(1, g.receipt.decode_tokens - 1))

    answer()  # warm: the kept buffers and the plans
    steps.clear()
    for _ in range(repeat):
        if rows == 1:
            answer()
            continue
        engine.runtime.batcher = batcher = Batcher(engine.runner, rows=rows)
        threads = [threading.Thread(target=answer) for _ in range(rows)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        engine.runtime.batcher = None
        batcher.close()
    return statistics.median(steps)


def plain_step_ms(engine: KVEngine, size: int, rows: int, tokens: int, repeat: int) -> float:
    """A plain transformers loop (the sdpa model, no kvrag code): `rows` copies of the same prompt
    read, then greedy steps over a `DynamicCache`."""
    model = engine.model.hf_model
    segments = engine.plan([long_document(engine.model.tokenizer, size)])
    ids = segments[0].ids + engine.planner.question(QUESTION, segments)
    times = []
    for run in range(repeat + 1):
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            out = model(input_ids=torch.tensor([ids] * rows), past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            began = time.perf_counter()
            for _ in range(tokens - 1):
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
            if run:  # the first run warms
                times.append((time.perf_counter() - began) * 1e3 / (tokens - 1))
    return statistics.median(times)


if __name__ == "__main__":
    main()
