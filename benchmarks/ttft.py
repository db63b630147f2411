"""Time to first token: text prefill vs graft from the memory store vs graft from the disk store.

Runs `smollm2-135m` (or --model; float32 or --dtype) under the default kernel (or --attn) on documents of about 500, 1,500 and 4,000 tokens built from the
bundled text, with a ~15-token question. Every arm is run --repeat times in one process, on the
same machine, and the median is reported; ratios are what to compare, since absolute times drift
on shared machines. Each graft is checked to give the text arm's first-token logits, byte for byte.

    python benchmarks/ttft.py                       # Markdown table
    python benchmarks/ttft.py --json out.json       # also the raw figures
    python benchmarks/ttft.py --attn sdpa,invariant --repeat 5   # the kernels side by side
    python benchmarks/ttft.py --dtype bfloat16

With several kernels (`--attn`), their arms are interleaved run by run, and one more table compares
their costs: text prefill and graft TTFT of each kernel against sdpa's, measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from tqdm import tqdm

from kvrag import DiskStore, KVEngine, MemoryStore, load_model
from kvrag.data import long_document

QUESTION = "According to the document, who built the lighthouse at Varrow Point, and when?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sizes", default="500,1500,4000", help="document sizes in tokens")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--attn", default="invariant", help="comma-separated kernels: invariant, sdpa, eager")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    results = measure(args.model, args.dtype, args.attn.split(","), [int(s) for s in args.sizes.split(",")], args.repeat)
    for attn, rows in results.items():
        print_table(args.model, args.dtype, attn, args.repeat, rows)
    if len(results) > 1:
        print_costs(results)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "repeat": args.repeat, "question": QUESTION,
                       "kernels": results}, f, indent=2)


def measure(model_name: str, dtype: str, attns: list[str], sizes: list[int], repeat: int) -> dict[str, list[dict]]:
    """Every kernel's arms interleaved, repeat by repeat, so that drift on a shared machine falls
    on all of them alike."""
    results: dict[str, list[dict]] = {attn: [] for attn in attns}
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        for attn in attns:
            model = load_model(model_name, dtype=dtype, attn=attn)
            engines[attn] = {"memory": KVEngine(model, MemoryStore()), "disk": KVEngine(model, DiskStore(f"{tmp}/{attn}"))}
        progress = tqdm(total=len(sizes) * len(attns) * (2 + 3 * repeat), desc="benchmark", unit="run")
        for size in sizes:
            runs = {}
            for attn, pair in engines.items():
                memory, disk = pair["memory"], pair["disk"]
                document = long_document(memory.model.tokenizer, size)
                refs = {"memory": memory.deposit(document), "disk": disk.deposit(document)}
                progress.update(2)
                runs[attn] = (refs, {"text": [], "memory": [], "disk": []}, set())
            for _ in range(repeat):
                for attn, pair in engines.items():
                    refs, times, hashes = runs[attn]
                    for arm, engine, graft in (("text", pair["memory"], False), ("memory", pair["memory"], True),
                                               ("disk", pair["disk"], True)):
                        ref = refs["disk" if arm == "disk" else "memory"]
                        generation = engine.generate(QUESTION, states=[ref], max_new_tokens=1, graft=graft, memo=False)
                        expected = "text-prefill" if arm == "text" else "exact-graft"
                        assert generation.receipt.mode == expected, generation.receipt
                        times[arm].append(generation.receipt.timings.ttft_ms)
                        hashes.add(generation.receipt.first_token_logits_sha256)
                        progress.update(1)
            for attn, (refs, times, hashes) in runs.items():
                memory = engines[attn]["memory"]
                median = {arm: statistics.median(values) for arm, values in times.items()}
                results[attn].append(
                    {
                        "document_tokens": refs["memory"].token_count,
                        "question_tokens": len(memory.layout.question_ids(QUESTION)),
                        "state_mib": round(_state_bytes(memory, refs["memory"].key) / 2**20, 1),
                        "ttft_text_ms": round(median["text"], 1),
                        "ttft_graft_memory_ms": round(median["memory"], 1),
                        "ttft_graft_disk_ms": round(median["disk"], 1),
                        "speedup_memory": round(median["text"] / median["memory"], 1),
                        "speedup_disk": round(median["text"] / median["disk"], 1),
                        "logits_identical": len(hashes) == 1,
                    }
                )
        progress.close()
    return results


def print_table(model_name: str, dtype: str, attn: str, repeat: int, rows: list[dict]) -> None:
    print(f"\nTime to first token, {model_name}, {dtype}, attn={attn}, CPU, median of {repeat} runs each\n")
    print("| state tokens (prompt prefix + document) | state size | text prefill | graft from memory store | graft from disk store | speed-up (memory) | speed-up (disk) | same logits |")
    print("|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        print(
            f"| {r['document_tokens']:,} | {r['state_mib']} MiB | {r['ttft_text_ms']:.0f} ms | {r['ttft_graft_memory_ms']:.0f} ms "
            f"| {r['ttft_graft_disk_ms']:.0f} ms | {r['speedup_memory']}x | {r['speedup_disk']}x | {'yes' if r['logits_identical'] else 'NO'} |"
        )


def print_costs(results: dict[str, list[dict]]) -> None:
    base = results.get("sdpa") or next(iter(results.values()))
    print("\nKernel cost against sdpa, same process (text prefill of the whole prompt; graft + question from memory)\n")
    print("| kernel | state tokens | text prefill | vs sdpa | graft TTFT | vs sdpa | graft speed-up over its own text prefill |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for attn, rows in results.items():
        for r, b in zip(rows, base):
            print(f"| {attn} | {r['document_tokens']:,} | {r['ttft_text_ms']:.0f} ms | {r['ttft_text_ms'] / b['ttft_text_ms']:.2f}x "
                  f"| {r['ttft_graft_memory_ms']:.0f} ms | {r['ttft_graft_memory_ms'] / b['ttft_graft_memory_ms']:.2f}x "
                  f"| {r['speedup_memory']}x |")


def _state_bytes(engine: KVEngine, key: str) -> int:
    return len(engine.store.read(key).payload)


if __name__ == "__main__":
    main()
