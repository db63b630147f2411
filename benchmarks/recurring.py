"""Recurring problems: decode tokens from a memo entry vs solving from scratch.

Adds the bundled verified problems to a solution library (`smollm2-135m`), then asks each problem
again, worded as a recurring variant (lower case, no final punctuation): it is answered from its
memo entry. The same problems solved from scratch (memo off, no solutions grafted, greedy, up to
--max-new-tokens) give the other column. Token counts, not times: they do not drift.

    python benchmarks/recurring.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from importlib import resources

from tqdm import tqdm

from kvrag import KVEngine, load_model
from kvrag.apps.library import Library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    items = [json.loads(line) for line in resources.files("kvrag.data").joinpath("problems.jsonl").read_text().splitlines() if line.strip()]
    engine = KVEngine(load_model("smollm2-135m"), "memory://")
    library = Library(engine)
    report = library.add(tqdm(items, desc="library add", unit="problem"))
    rows = []
    for entry in tqdm(library.entries(), desc="recurring vs scratch", unit="problem"):
        variant = entry.problem.lower().rstrip("?.! ")
        memo, _ = library.solve(variant)
        scratch = engine.generate(entry.problem, memo=False, max_new_tokens=args.max_new_tokens)
        rows.append({"id": entry.id, "memo_mode": memo.receipt.mode, "memo_decode_tokens": memo.receipt.decode_tokens,
                     "memo_forward_tokens": memo.receipt.decode_tokens + memo.receipt.tokens_prefilled,
                     "scratch_decode_tokens": scratch.receipt.decode_tokens, "scratch_finished": scratch.finish_reason == "stop",
                     "memo_answer_is_verified_solution": memo.text == entry.solution})
    memo_total = sum(r["memo_decode_tokens"] for r in rows)
    forward_total = sum(r["memo_forward_tokens"] for r in rows)
    scratch_total = sum(r["scratch_decode_tokens"] for r in rows)
    print(f"\nlibrary: {len(report.added)} verified problems added, {len(report.rejected)} rejected by the verifier "
          f"({', '.join(report.rejected)})\n")
    print("| problem | recurring answer | memo decode tokens | from scratch decode tokens |\n|---|---|---:|---:|")
    for r in rows:
        cap = "" if r["scratch_finished"] else f" (cut at {args.max_new_tokens})"
        print(f"| {r['id']} | {r['memo_mode']}, verified solution: {'yes' if r['memo_answer_is_verified_solution'] else 'NO'} "
              f"| {r['memo_decode_tokens']} | {r['scratch_decode_tokens']}{cap} |")
    print(f"\nTotal: {memo_total} memo decode tokens ({forward_total} forward tokens with the fed answer token) vs "
          f"{scratch_total} from scratch: {scratch_total / max(memo_total, 1):.0f}x fewer decode tokens "
          f"({scratch_total / max(forward_total, 1):.0f}x fewer forward tokens).")
    finished = [r for r in rows if r["scratch_finished"]]
    if len(finished) < len(rows):
        memo_finished = sum(r["memo_decode_tokens"] for r in finished)
        scratch_finished = sum(r["scratch_decode_tokens"] for r in finished)
        print(f"Without {', '.join(r['id'] for r in rows if not r['scratch_finished'])}, whose solutions from scratch were "
              f"cut at {args.max_new_tokens} tokens: {memo_finished} memo decode tokens against {scratch_finished}, "
              f"{scratch_finished / max(memo_finished, 1):.0f}x fewer.")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"rows": rows, "memo_decode_tokens": memo_total, "scratch_decode_tokens": scratch_total,
                       "memo_forward_tokens": forward_total}, f, indent=2)


if __name__ == "__main__":
    main()
