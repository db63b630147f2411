"""`kvrag ab` under both deposit policies at several k, and each exact lever under `lazy`.

Runs the A/B harness (`kvrag.apps.ab.run_ab`) on the bundled set with smollm2-135m in one process,
each configuration on a fresh memory store (Redis is measured in "Stores and tiers"), and prints
the tables of docs/benchmarks/ab-policies.md: receipt mode mix, whole-context hit rate, token reuse, median TTFT ratio
overall and per mode, accuracy per arm, and the deposit cost.

    python benchmarks/ab_policies.py                   # policies at k=1,3,5, the levers and the blend at k=3
    python benchmarks/ab_policies.py --lever-ks 3,5    # the levers at k=3 and k=5
    python benchmarks/ab_policies.py --json out.json   # also every summary
    python benchmarks/ab_policies.py --streams zipf,uniform --n 80 --ks 3,1,5 --lever-ks 3,5 --policies lazy \
        --max-new-tokens 8                             # drawn streams of 80 questions (kvrag.apps.ab.streams):
                                                       # docs/benchmarks/ab-policies.md, "Skewed traffic"
"""

from __future__ import annotations

import argparse
import json

from tqdm import tqdm

from kvrag import KVEngine, MemoryStore, load_model
from kvrag.apps.ab import ABSummary, load_jsonl, run_ab, skewed_stream
from kvrag.data import sample_paths

#: the levers, each under the lazy policy at --lever-k
LEVERS = [
    ("lazy + canonical order", {"order": "canonical"}),
    ("lazy + chapters of 768 tokens", {"chapters": 768}),
    ("lazy + chain warming", {"warm_chains": True}),
    ("lazy + canonical order + chain warming", {"order": "canonical", "warm_chains": True}),
    ("lazy + stored-first order", {"order": "stored-first"}),
    ("lazy + corpus chain", {"corpus_chain": True}),
    ("lazy + blend 0.15 (approximate)", {"blend": 0.15}),
]


def line(label: str, s: ABSummary) -> str:
    modes = ", ".join(f"{m} {n}" for m, n in s.mode_mix.items())
    per_mode = ", ".join(f"{m} {v:.1f}x" for m, v in s.ttft_ratio_by_mode.items())
    return (f"| {label} | {s.k} | {modes} | {s.full_hit_rate:.2f} | {s.token_reuse_rate:.0%} | {s.ttft_ratio_median:.1f}x / "
            f"{s.ttft_ratio_p90:.1f}x / {s.ttft_ratio_sum:.1f}x | {per_mode} | {s.accuracy_text_retrieval_order:.2f} / "
            f"{s.accuracy_text:.2f} / {s.accuracy_kv:.2f} | {s.logits_byte_exact_rate:.2f} / {s.monolithic_byte_exact_rate:.2f} | {s.bytes_stored / 2**20:.0f} MiB | "
            f"{s.upfront_deposit_ms / 1e3:.1f} / {s.deposit_before_ms / 1e3:.1f} / {s.deposit_after_ms / 1e3:.1f} s |")


def record(label: str, s: ABSummary) -> dict:
    """A run's summary without its rows, with the lever table's counts that the rows give."""
    return {"label": label, **s.model_dump(mode="json", exclude={"rows"}),
            "reordered_rows": sum(r.order_changed for r in s.rows),
            "answers_changed_by_order": sum(r.answer_changed_by_order for r in s.rows),
            "answers_changed_by_blend": sum(r.answer_changed_by_blend for r in s.rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ks", default="1,3,5")
    parser.add_argument("--lever-ks", default="3", help="the k values the levers run at (comma-separated)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--only", help="comma-separated words: run only the configurations whose label has one")
    parser.add_argument("--skip", help="comma-separated words: leave out the configurations whose label has one")
    parser.add_argument("--policies", default="lazy,warm", help="the policies run at every k")
    parser.add_argument("--streams", default="", help="comma-separated uniform, zipf: drawn streams instead of the bundled questions as given")
    parser.add_argument("--n", type=int, default=80, help="questions per drawn stream")
    parser.add_argument("--zipf-s", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    model = load_model(args.model)
    docs_path, questions_path = sample_paths()
    docs = load_jsonl(docs_path, ["id", "title", "text"])
    bundled = load_jsonl(questions_path, ["id", "question", "answers"])
    streams = {name: skewed_stream(docs, bundled, n=args.n, stream=name, s=args.zipf_s, seed=args.seed)
               for name in filter(None, args.streams.split(","))} or {"bundled": bundled}
    # the policies at every k first, then each lever at each lever k, every stream side by side
    runs: list[tuple[str, str, dict]] = [
        (stream, policy, {"k": int(k), "policy": policy})
        for k in filter(None, args.ks.split(",")) for stream in streams for policy in args.policies.split(",")]
    runs += [(stream, label, {"k": int(k), "policy": "lazy", **options})
             for k in filter(None, args.lever_ks.split(",")) for label, options in LEVERS for stream in streams]
    if args.only:
        runs = [r for r in runs if any(word in f"{r[0]} {r[1]}" for word in args.only.split(","))]
    if args.skip:
        runs = [r for r in runs if not any(word in f"{r[0]} {r[1]}" for word in args.skip.split(","))]
    print(f"{args.model}, bundled documents ({len(docs)}), questions: {', '.join(f'{n} ({len(q)})' for n, q in streams.items())}"
          f"{f', seed {args.seed}' if args.streams else ''}; memory store\n")
    print("| stream | policy | k | KV modes | whole context grafted | tokens reused | TTFT ratio: median / p90 / summed | "
          "TTFT ratio per mode | accuracy: text in retrieval order / text / KV | logits byte-exact: text arm / stock one pass | "
          "bytes stored | "
          "deposits: up front / before questions / after answers |")
    print("|---|---|---:|---|---:|---:|---|---|---|---:|---:|---|", flush=True)
    results = []
    for stream, label, options in tqdm(runs, desc="A/B runs", unit="run"):
        summary = run_ab(KVEngine(model, MemoryStore()), docs, streams[stream], max_new_tokens=args.max_new_tokens, **options)
        results.append((f"{stream}: {label}", summary))
        print(f"| {stream} {line(label, summary)}", flush=True)  # each row as soon as its run ends
        if args.json_path:  # rewritten after every run, so a run cut short keeps what it measured
            with open(args.json_path, "w", encoding="utf-8") as f:
                json.dump([record(label, s) for label, s in results], f, indent=2)
    print("\n| lever (lazy) | k | reordered rows | answers changed by the order | approximate rows | "
          "answers changed by the blend | KL vs exact text arm (mean) | first-token argmax agreement | gate |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for label, s in [(label, s) for label, s in results if "lazy +" in label]:
        gate = s.blend_gate
        verdict = (f"{'allowed' if gate['passed'] else 'refused'}: KL {gate['kl_mean']:.3g}, agreement "
                   f"{gate['argmax_agreement']:.0%} on {gate['samples']}") if gate else "-"
        counts = record(label, s)
        print(f"| {label} | {s.k} | {counts['reordered_rows']} | {counts['answers_changed_by_order']} | "
              f"{s.approximate_rows} | {counts['answers_changed_by_blend']} | {s.kl_mean_approximate:.3g} | {s.argmax_agreement_approximate:.2f} | {verdict} |")


if __name__ == "__main__":
    main()
