"""Each prompt-changing lever on several independent streams, per model: what it buys (questions
grafting their whole context) and what it costs (accuracy against text RAG in retrieval order,
with 95% intervals), and how much a small model's answers depend on where its document sits.

Runs `kvrag.apps.ab.sweep_levers` on the bundled set (8 documents, 18 questions with two
paraphrases each), each run on a fresh memory store, and prints the tables of
docs/benchmarks/ab-levers.md.

    python benchmarks/ab_levers.py                                  # smollm2-135m and gemma3-270m, 3 streams
    python benchmarks/ab_levers.py --models smollm2-135m --streams 6 --n 80 --levers canonical
    python benchmarks/ab_levers.py --json benchmarks/results/ab_levers.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

from tqdm import tqdm

from kvrag import KVEngine, MemoryStore, load_model
from kvrag.apps.ab import LeverSweep, independent_streams, load_jsonl, position_sensitivity, sweep_levers
from kvrag.data import sample_paths

#: the levers this script can measure, each under the lazy policy
LEVERS = {
    "canonical": ("canonical order", {"order": "canonical"}),
    "stored-first": ("stored-first order", {"order": "stored-first"}),
    "chapters": ("chapters of 768 tokens", {"chapters": 768}),
    "warming": ("chain warming", {"warm_chains": True}),
}


def tables(sweep: LeverSweep) -> str:
    lines = [f"\n### {sweep.model}, k = {sweep.k}\n",
             "| stream | lever | whole context grafted: lever / none | accuracy: lever / retrieval order [95%] | "
             "difference [95%] | answers changed | holds |",
             "|---|---|---|---|---|---:|---|"]
    for r in sweep.runs:
        ci = r.accuracy_retrieval_order
        lines.append(f"| {r.stream.label} | {r.lever} | {r.whole_context:.2f} / {r.whole_context_baseline:.2f} | "
                     f"{r.accuracy:.2f} / {ci.estimate:.2f} [{ci.low:.2f}, {ci.high:.2f}] | {r.difference} | "
                     f"{r.answers_changed} of {r.n} | {'yes' if r.holds else 'no'} |")
    lines += ["", "| lever | streams | rows | whole context grafted: lever (min-max) / none | accuracy difference, pooled [95%] | "
              "answers changed | holds: every stream and pooled |", "|---|---:|---:|---|---|---:|---|"]
    for v in sweep.verdicts:
        lines.append(f"| {v.lever} | {v.streams} | {v.rows} | {v.whole_context.mean:.2f} ({v.whole_context.low:.2f}-"
                     f"{v.whole_context.high:.2f}) / {v.whole_context_baseline.mean:.2f} | {v.difference} | "
                     f"{v.answers_changed} of {v.rows} | {'yes' if v.holds else 'no'} |")
    if sweep.positions:
        p = sweep.positions
        lines += ["", f"Position of the question's own document ({p.questions} questions, text RAG, others in retrieval order):",
                  "", "| " + " | ".join(f"read {i + 1} of {p.k}" for i in range(p.k)) + " |",
                  "|" + "---|" * p.k,
                  "| " + " | ".join(f"{a.estimate:.2f} [{a.low:.2f}, {a.high:.2f}]" for a in p.accuracy_by_position) + " |"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--levers", default="canonical,stored-first", help=f"comma-separated, of {', '.join(LEVERS)}")
    parser.add_argument("--streams", type=int, default=3, help="independent streams per model")
    parser.add_argument("--n", type=int, default=40, help="questions per stream")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1, help="the first stream's seed (the bundled pages used seed 0)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--no-positions", action="store_true", help="skip the position measurement")
    parser.add_argument("--positions-only", action="store_true",
                        help="only the position measurement, over every phrasing of every question")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    docs_path, questions_path = sample_paths()
    docs = load_jsonl(docs_path, ["id", "title", "text"])
    questions = load_jsonl(questions_path, ["id", "question", "answers"])
    levers = dict(LEVERS[name] for name in args.levers.split(","))
    streams = independent_streams(args.streams, n=args.n, seed=args.seed)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"{cpu}, commit {commit}, {time.strftime('%Y-%m-%d')}; memory store, lazy policy, greedy, "
          f"at most {args.max_new_tokens} new tokens")
    results: list = []

    def write(figures: dict) -> None:
        """The results so far, rewritten after every model, so a run cut short keeps what it measured."""
        if args.json_path:
            with open(args.json_path, "w", encoding="utf-8") as f:
                json.dump({"cpu": cpu, "commit": commit, "date": time.strftime("%Y-%m-%d"), **figures}, f, indent=2)

    for name in args.models.split(","):
        model = load_model(name)
        if args.positions_only:
            measured = position_sensitivity(KVEngine(model, MemoryStore()), docs, questions, k=args.k,
                                            max_new_tokens=args.max_new_tokens, phrasings="all")
            print(f"\n{name}, {measured.questions} phrasings, own document read at 1..{measured.k}: " + ", ".join(
                f"{a.estimate:.2f} [{a.low:.2f}, {a.high:.2f}]" for a in measured.accuracy_by_position), flush=True)
            results.append(measured)
            write({"positions": {n: p.model_dump(mode="json") for n, p in zip(args.models.split(","), results)}})
            continue
        bars: dict[str, tqdm] = {}

        def progress(label: str, done: int, total: int) -> None:
            bar = bars.get(label) or bars.setdefault(label, tqdm(total=total, desc=f"{name}: {label}", unit="q"))
            bar.update(done - bar.n)
            if done == total:
                bar.close()

        sweep = sweep_levers(KVEngine(model, MemoryStore()), docs, questions, levers, streams=streams, k=args.k,
                             max_new_tokens=args.max_new_tokens, positions=not args.no_positions, progress=progress)
        results.append(sweep)
        print(tables(sweep), flush=True)
        write({"sweeps": [s.model_dump(mode="json") for s in results]})


if __name__ == "__main__":
    main()
