"""The paper's exactness table, reproduced on this machine: `kvrag verify` for every tiny-random family,
dtype and attention kernel, plus `smollm2-135m` in float32. Prints a Markdown table.

    python benchmarks/verify_table.py --samples 50 [--json out.json]
    python benchmarks/verify_table.py --attn invariant      # only the invariant kernel's rows
    python benchmarks/verify_table.py --model gemma3-270m --dtype float32,bfloat16   # one model's rows
"""

from __future__ import annotations

import argparse
import json

from tqdm import tqdm

from kvrag import load_model, verify_model
from kvrag.models.tiny import TINY_FAMILIES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--no-smollm2", action="store_true", help="skip the real model (about 2 minutes)")
    parser.add_argument("--attn", default="sdpa,eager,invariant", help="comma-separated kernels")
    parser.add_argument("--model", help="only this model's rows (with --dtype)")
    parser.add_argument("--dtype", default="float32,bfloat16", help="with --model: comma-separated dtypes")
    args = parser.parse_args()

    attns = args.attn.split(",")
    if args.model:
        runs = [(args.model, d, a) for a in attns for d in args.dtype.split(",")]
        return report(runs, args.samples, args.json_path)
    runs = [(f"tiny-random-{f}", d, a) for f in sorted(TINY_FAMILIES) for d in ("float32", "bfloat16") for a in attns]
    if not args.no_smollm2:
        runs += [("smollm2-135m", "float32", a) for a in attns]
        runs += [("smollm2-135m", "bfloat16", "invariant")] if "invariant" in attns else []
    report(runs, args.samples, args.json_path)


def report(runs: list[tuple[str, str, str]], samples: int, json_path: str | None) -> None:
    reports = []
    for name, dtype, attn in tqdm(runs, desc="verify", unit="model"):
        reports.append(verify_model(load_model(name, dtype=dtype, attn=attn), samples=samples))

    print("\n| model | dtype | attn | prompt tokens | byte-exact | KL max | argmax | fallback byte-exact "
          "| monolithic byte-exact | monolithic KL max | monolithic argmax | monolithic max abs diff "
          "| chain states = from scratch |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in reports:
        m = r.monolithic
        print(f"| {r.model} | {r.dtype} | {r.attn} | {r.prompt_tokens_min}-{r.prompt_tokens_max} | {r.byte_exact}/{r.samples} "
              f"| {r.kl_max:.3g} | {r.argmax_agreement:.0%} | {r.fallback_byte_exact}/{r.samples} | {m.byte_exact}/{m.samples} "
              f"| {m.kl_max:.2g} | {m.argmax_agreement:.0%} | {m.max_abs_diff:.2g} "
              f"| {r.chain_states_byte_exact}/{r.chain_states} |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump([r.model_dump() for r in reports], f, indent=2)


if __name__ == "__main__":
    main()
