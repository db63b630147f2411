"""The long form of `tests/integration/test_under_load.py`: `kvrag serve` under load answers as it
answers alone, over every tiny family in both dtypes and smollm2-135m, with the memory tier alone
and Redis behind it, at several client counts.

For each setup it starts its own Redis and `kvrag serve` (batching on, deposits in the background,
`--tenants` tenants with keys), sends `--answers` requests from N clients at once (cold and warm
asks of shared documents, every fifth client going away mid-answer), then each answered request
again, alone, and counts answers whose first-token logits SHA-256 or text differ from the solo
answer. Prints one row per setup; exits 1 if any answer was unlike its solo one or failed.

    python benchmarks/under_load.py [--answers 3000] [--clients 8,16] [--tenants 4]
                                    [--models tiny-random-llama:float32,...,smollm2-135m:float32]
                                    [--stores memory,redis] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvrag.data import sample_docs  # noqa: E402
from kvrag.models import TINY_FAMILIES  # noqa: E402
from kvrag.testing import KVRagServer, RedisServer, answers_under_load  # noqa: E402
from tests.integration.test_under_load import workload  # noqa: E402

ALL_MODELS = [f"tiny-random-{f}:{d}" for f in sorted(TINY_FAMILIES) for d in ("float32", "bfloat16")] + \
    ["smollm2-135m:float32"]


def one_setup(model: str, dtype: str, store: str, clients: int, tenants: int, answers: int, folder: Path) -> dict:
    keys = [f"key-of-bench-tenant-{i}-0123456789" for i in range(tenants)]
    (folder / "keys.txt").write_text("".join(f"{key} tenant-{i}\n" for i, key in enumerate(keys)))
    redis = RedisServer(folder / "redis").start() if store == "redis" else None
    server = KVRagServer(model, redis.url if redis else "memory://?max_mib=1024",
                         ("--api-key-file", str(folder / "keys.txt"), "--dtype", dtype, "--concurrency", str(clients),
                          "--queue", str(4 * clients)), log=folder / "serve.log", api_key=keys[0]).start()
    documents = [d.text for d in sample_docs()][:8]
    try:
        requests = workload(keys, per_tenant=-(-answers // tenants), documents=documents)[:answers]
        began = time.perf_counter()
        report = answers_under_load(server, requests, clients=clients, model=model)
        seconds = time.perf_counter() - began
    finally:
        server.stop(kill=True)
        if redis:
            redis.stop()
    return {"model": model, "dtype": dtype, "store": store, "clients": clients, "requests": len(requests),
            "answered": report.answered, "left": report.left, "failed": len(report.failed),
            "unlike": len(report.unlike), "modes": report.modes, "seconds": round(seconds, 1),
            "examples": (report.failed + report.unlike)[:5]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", type=int, default=3000, help="requests per setup")
    parser.add_argument("--clients", default="8,16", help="client counts, comma-separated")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--models", default=",".join(ALL_MODELS), help="model:dtype, comma-separated")
    parser.add_argument("--stores", default="memory,redis")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# {platform.processor() or platform.machine()}, commit {commit}, {time.strftime('%Y-%m-%d')}")
    print("| model | dtype | store | clients | requests | answered | left | failed | unlike solo | modes | s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    rows = []
    for spec in args.models.split(","):
        model, _, dtype = spec.partition(":")
        for store in args.stores.split(","):
            for clients in map(int, args.clients.split(",")):
                with tempfile.TemporaryDirectory() as folder:
                    row = one_setup(model, dtype or "float32", store, clients, args.tenants, args.answers, Path(folder))
                rows.append(row)
                modes = " ".join(f"{k} {v}" for k, v in sorted(row["modes"].items()))
                print(f"| {model} | {row['dtype']} | {store} | {clients} | {row['requests']} | {row['answered']} | "
                      f"{row['left']} | {row['failed']} | {row['unlike']} | {modes} | {row['seconds']} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 1 if any(r["failed"] or r["unlike"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
