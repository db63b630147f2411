"""Store tiers: verified restore throughput, and time to first token when grafting from Redis.

Part 1 stores a 64 MiB and a 256 MiB payload in each tier (memory, warm disk, one Redis server
and a 3-master Redis Cluster on loopback, both started here and stopped after, each read as
configured by default and as it was read before: one connection, through redis-py) and times a
verified restore: fetch plus SHA-256 of every 8 MiB chunk against the state's digests. Part 2
grafts a ~1,500-token `smollm2-135m` state from each tier and compares time to first token with
text prefill, and as a `kvrag serve` worker reads (its in-process hot tier hit, and missed).
Medians of --repeat runs, one process, one machine: compare the ratios.

    python benchmarks/stores.py [--repeat 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from kvrag import KVEngine, load_model
from kvrag.artifacts.digests import CHUNK_BYTES, CheckedBuffer, chunk_digests
from kvrag.data import long_document
from kvrag.stores import Checked, PayloadLayout, open_store
from kvrag.testing import RedisCluster, RedisServer

QUESTION = "According to the document, who built the lighthouse at Varrow Point, and when?"


def verified_restore(store, key: str, digests: list[str], size: int) -> float:
    """A read as the engine's checks make it: the layout known before the payload (as a checked
    manifest gives it), every chunk's SHA-256 compared, by the store as it reads or here after."""
    layout = PayloadLayout(size, CHUNK_BYTES, digests)
    began = time.perf_counter()
    payload = store.read(key, lambda raw: Checked(None, layout)).payload
    if not (isinstance(payload, CheckedBuffer) and list(payload.chunk_digests) == digests):
        assert chunk_digests(payload) == digests
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kvrag-bench-"))
    server = RedisServer(tmp / "redis").start()
    cluster = RedisCluster(tmp / "cluster").start()
    tiers = {
        "memory": "memory://",
        "disk (warm)": f"disk://{tmp / 'disk'}",
        "redis": server.url,
        "redis cluster": cluster.url,
        "redis, 1 connection, via redis-py": f"{server.url}?streams=1&wire=client",  # how every read went before
        "redis cluster, 1 connection, via redis-py": f"{cluster.url}?streams=1&wire=client",
    }
    # as a `kvrag serve` worker reads: its in-process LRU first (big enough to hold the state: a
    # hit after the first read; 1 MiB: it can never hold it, every read misses it), then Redis
    served = {
        "redis behind the hot tier (hit)": f"memory://?max_mib=1024,{server.url}",
        "redis behind the hot tier (missed)": f"memory://?max_mib=1,{server.url}",
        "redis cluster behind the hot tier (missed)": f"memory://?max_mib=1,{cluster.url}",
    }
    results: dict = {"throughput": [], "ttft": {}}
    try:
        for mib in (64, 256):
            payload = os.urandom(mib << 20)
            digests = chunk_digests(payload)
            key = f"{mib:04x}" * 16
            for name, url in tqdm(tiers.items(), desc=f"restore {mib} MiB", unit="tier"):
                store = open_store(url)
                store.put(key, b"{}", payload)
                verified_restore(store, key, digests, len(payload))  # warm: page cache, connections
                times = [verified_restore(store, key, digests, len(payload)) for _ in range(args.repeat)]
                median = statistics.median(times)
                results["throughput"].append({"tier": name, "mib": mib, "ms": round(median * 1e3, 1),
                                              "gib_per_s": round(mib / 1024 / median, 2)})
                store.delete(key)
                store.close()
            del payload

        model = load_model("smollm2-135m")
        document = long_document(model.tokenizer, args.tokens)
        engines = {name: KVEngine(model, url) for name, url in {**tiers, **served}.items()}
        refs = {name: engine.deposit(document) for name, engine in engines.items()}
        ttft: dict[str, list[float]] = {name: [] for name in ["text", *engines]}
        hashes = set()
        for _ in tqdm(range(args.repeat), desc="time to first token", unit="round"):
            text = engines["memory"].generate(QUESTION, states=[refs["memory"]], max_new_tokens=1, graft=False)
            ttft["text"].append(text.receipt.timings.ttft_ms)
            hashes.add(text.receipt.first_token_logits_sha256)
            for name, engine in engines.items():
                graft = engine.generate(QUESTION, states=[refs[name]], max_new_tokens=1)
                assert graft.receipt.mode == "exact-graft", graft.receipt
                ttft[name].append(graft.receipt.timings.ttft_ms)
                hashes.add(graft.receipt.first_token_logits_sha256)
        results["ttft"] = {name: round(statistics.median(v), 1) for name, v in ttft.items()}
        results["state_tokens"] = refs["memory"].token_count
        results["logits_identical"] = len(hashes) == 1
    finally:
        server.stop()
        cluster.stop()

    print("\nVerified restore throughput (fetch + SHA-256 of every 8 MiB chunk), median of", args.repeat)
    print("\n| tier | 64 MiB state | 256 MiB state |\n|---|---:|---:|")
    for name in tiers:
        cells = [r for r in results["throughput"] if r["tier"] == name]
        print(f"| {name} | " + " | ".join(f"{r['gib_per_s']} GiB/s ({r['ms']:.0f} ms)" for r in cells) + " |")
    t = results["ttft"]
    print(f"\nTime to first token, smollm2-135m, {results['state_tokens']:,}-token state, ~15-token question, median of {args.repeat}")
    print("\n| arm | TTFT | text prefill / arm | arm / memory graft |\n|---|---:|---:|---:|")
    for name in ["text", *tiers, *served]:
        label = "text prefill" if name == "text" else f"graft from {name}"
        print(f"| {label} | {t[name]:.0f} ms | {t['text'] / t[name]:.1f}x | {t[name] / t['memory']:.2f}x |")
    print(f"\nfirst-token logits identical in every arm: {'yes' if results['logits_identical'] else 'NO'}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
