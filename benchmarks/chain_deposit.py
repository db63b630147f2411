"""Cost of depositing a chain: each new state after its verified ancestors.

Deposits a chain of --docs documents of about --tokens tokens each into an empty memory store and
reports the time of each deposit (compute + verification + store), median of --repeat fresh
chains, in one process. With ancestors grafted, deposit n costs about the same as deposit 1
(linear in the chain's length); recomputing every ancestor from scratch makes deposit n cost
about n times deposit 1 (quadratic in total).

    python benchmarks/chain_deposit.py                       # Markdown table
    python benchmarks/chain_deposit.py --json out.json       # also the raw figures
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tqdm import tqdm

from kvrag import KVEngine, MemoryStore, load_model
from kvrag.data import long_document


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    model = load_model(args.model)
    base = long_document(model.tokenizer, args.tokens * args.docs)
    words = base.split()
    step = len(words) // args.docs
    texts = [" ".join(words[i * step : (i + 1) * step]) for i in range(args.docs)]
    times: list[list[float]] = [[] for _ in texts]
    for run in tqdm(range(args.repeat), desc="chains", unit="chain"):
        engine = KVEngine(model, MemoryStore())
        after = None
        for index, text in enumerate(texts):
            began = time.perf_counter()
            after = engine.deposit(f"[run {run}] {text}" if index == 0 else text, after=after)
            times[index].append((time.perf_counter() - began) * 1e3)
    medians = [statistics.median(t) for t in times]
    tokens = [len(engine.layout.document_ids(t)) for t in texts]
    print("| state in chain | tokens | deposit (ms) | vs first |")
    print("|---:|---:|---:|---:|")
    for index, (ms, n) in enumerate(zip(medians, tokens), 1):
        print(f"| {index} | {n} | {ms:.0f} | {ms / medians[0]:.2f}x |")
    print(f"| all {len(texts)} | {sum(tokens)} | {sum(medians):.0f} | |")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "tokens": tokens, "deposit_ms": medians}, f, indent=2)


if __name__ == "__main__":
    main()
