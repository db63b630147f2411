"""`kvrag ab` under both deposit policies at several k, and each exact lever under `lazy`.

Runs the A/B harness (`kvrag.apps.ab.run_ab`) on the bundled set with smollm2-135m in one process,
each configuration on a fresh memory store (Redis is measured in "Stores and tiers"), and prints
the tables of docs/benchmarks/ab-policies.md: receipt mode mix, whole-context hit rate, token reuse, median TTFT ratio
overall and per mode, accuracy per arm, and the deposit cost.

    python benchmarks/ab_policies.py                   # policies at k=1,3,5, the levers and the blend at k=3
    python benchmarks/ab_policies.py --json out.json   # also every summary
"""

from __future__ import annotations

import argparse
import json

from tqdm import tqdm

from kvrag import KVEngine, MemoryStore, load_model
from kvrag.apps.ab import ABSummary, load_jsonl, run_ab
from kvrag.data import sample_paths


def line(label: str, s: ABSummary) -> str:
    modes = ", ".join(f"{m} {n}" for m, n in s.mode_mix.items())
    per_mode = ", ".join(f"{m} {v:.1f}x" for m, v in s.ttft_ratio_by_mode.items())
    return (f"| {label} | {s.k} | {modes} | {s.full_hit_rate:.2f} | {s.token_reuse_rate:.0%} | {s.ttft_ratio_median:.1f}x | "
            f"{per_mode} | {s.accuracy_text:.2f} / {s.accuracy_kv:.2f} | {s.logits_byte_exact_rate:.2f} | "
            f"{s.upfront_deposit_ms / 1e3:.1f} / {s.deposit_before_ms / 1e3:.1f} / {s.deposit_after_ms / 1e3:.1f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ks", default="1,3,5")
    parser.add_argument("--lever-k", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--only", help="comma-separated words: run only the configurations whose label has one")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    model = load_model(args.model)
    docs_path, questions_path = sample_paths()
    docs = load_jsonl(docs_path, ["id", "title", "text"])
    questions = load_jsonl(questions_path, ["id", "question", "answers"])
    runs: list[tuple[str, dict]] = []
    for k in (int(x) for x in args.ks.split(",")):
        runs += [("lazy", {"k": k, "policy": "lazy"}), ("warm", {"k": k, "policy": "warm"})]
    k = args.lever_k
    runs += [
        ("lazy + stored-first order", {"k": k, "policy": "lazy", "order": "stored-first"}),
        ("lazy + corpus chain", {"k": k, "policy": "lazy", "corpus_chain": True}),
        ("lazy + chain warming", {"k": k, "policy": "lazy", "warm_chains": True}),
        ("lazy + blend 0.15 (approximate)", {"k": k, "policy": "lazy", "blend": 0.15}),
    ]
    if args.only:
        runs = [r for r in runs if any(word in r[0] for word in args.only.split(","))]
    print(f"{args.model}, bundled set ({len(questions)} questions, {len(docs)} documents), memory store\n")
    print("| policy | k | KV modes | whole context grafted | tokens reused | TTFT ratio (median) | TTFT ratio per mode | "
          "accuracy text / KV | logits byte-exact | deposits: up front / before questions / after answers |")
    print("|---|---:|---|---:|---:|---:|---|---|---:|---|", flush=True)
    results = []
    for label, options in tqdm(runs, desc="A/B runs", unit="run"):
        summary = run_ab(KVEngine(model, MemoryStore()), docs, questions, max_new_tokens=args.max_new_tokens, **options)
        results.append((label, summary))
        print(line(label, summary), flush=True)  # each row as soon as its run ends
    print("\n| lever (k=%d, lazy) | reordered rows | answers changed by the order | approximate rows | "
          "answers changed by the blend | KL vs exact text arm (mean) | first-token argmax agreement | gate |" % k)
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for label, s in [(label, s) for label, s in results if label.startswith("lazy +")]:
        gate = s.blend_gate
        verdict = (f"{'allowed' if gate['passed'] else 'refused'}: KL {gate['kl_mean']:.3g}, agreement "
                   f"{gate['argmax_agreement']:.0%} on {gate['samples']}") if gate else "-"
        print(f"| {label} | {sum(r.order_changed for r in s.rows)} | {sum(r.answer_changed_by_order for r in s.rows)} | "
              f"{s.approximate_rows} | {sum(r.answer_changed_by_blend for r in s.rows)} | {s.kl_mean_approximate:.3g} | {s.argmax_agreement_approximate:.2f} | {verdict} |")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump([{"label": label, **s.model_dump(mode="json", exclude={"rows"})} for label, s in results], f, indent=2)


if __name__ == "__main__":
    main()
