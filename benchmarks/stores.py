"""Store tiers: verified restore throughput by per-read check, and grafts from each tier.

Part 1 stores a 64 MiB and a 256 MiB payload in each tier (memory, warm disk, one Redis server
and a 3-master Redis Cluster on loopback, both started here and stopped after) and times a
verified restore with each per-read check: SHA-256 of every chunk (`CHUNK_BYTES`; states written before
keyed tags), the keyed BLAKE3 tag every state carries now, and AES-256-GCM (confidential states:
the check also decrypts; the memory tier checks bytes it holds once, so its first reads and its
reads again are two rows). Beside them, the same bytes with no check at all, and for Redis a
plain redis-py `GET` loop over the frames: the wire's own speed. Part 2 grafts `smollm2-135m` states of
about 500, 1,500 and 4,000 tokens from each tier, plain and confidential, and compares time to
first token with a graft from memory and with text prefill, read whole before the forward (the
default) and, for some, streamed (the question's forward starts once layer 0 is checked);
restore and forward times per arm, and how much of them overlapped, show where the time goes. Medians of --repeat runs, one process, one machine: compare ratios.

    python benchmarks/stores.py [--repeat 5] [--tokens 500,1500,4000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import redis
from tqdm import tqdm

from kvrag import KVEngine, load_model
from kvrag.artifacts.digests import CHUNK_BYTES, PayloadChunking, chunk_digests, open_payload
from kvrag.artifacts.format import StateManifest
from kvrag.artifacts.payloads import chunking_of, seal_payload
from kvrag.data import long_document
from kvrag.stores import Accepted, open_store
from kvrag.testing import RedisCluster, RedisServer

QUESTION = "According to the document, who built the lighthouse at Varrow Point, and when?"
KEY = b"a-benchmark-signing-key"
CHECKS = ("none", "sha256", "blake3-keyed/1", "aes-256-gcm/1")


def chunkings(payload: bytes, key: str) -> dict[str, tuple[bytes, PayloadChunking | None]]:
    """Per check: the bytes to store and the chunking a reader checks them by (None: no check)."""
    arms: dict[str, tuple[bytes, PayloadChunking | None]] = {"none": (payload, None)}
    digests = chunk_digests(payload)
    arms["sha256"] = (payload, PayloadChunking(len(payload), CHUNK_BYTES, digests))
    for confidential in (False, True):
        stored, seal = seal_payload(payload, KEY, key, CHUNK_BYTES, confidential=confidential)
        data = bytes(stored.view()) if confidential else stored
        stored_digests = chunk_digests(data)
        manifest = StateManifest.model_construct(key=key, payload_bytes=len(data), payload_chunk_bytes=CHUNK_BYTES,
                                                 payload_chunks=stored_digests, payload_seal=seal, payload_sha256="")
        arms[seal.scheme] = (data, chunking_of(manifest, KEY))
    return arms


def verified_restore(store, key: str, chunking: PayloadChunking | None) -> float:
    """A read as the engine's checks make it: the chunking known before the payload (as a checked
    manifest gives it), every chunk checked by the store as it reads, or here after (memory)."""
    began = time.perf_counter()
    payload = store.read(key, None if chunking is None else lambda raw: Accepted(None, chunking)).payload
    if chunking is not None:
        assert open_payload(payload, chunking) is not None
    return time.perf_counter() - began


def add_throughput(results: dict, tier: str, check: str, mib: int, times: list[float]) -> None:
    median = statistics.median(times)
    results["throughput"].append({"tier": tier, "check": check, "mib": mib, "ms": round(median * 1e3, 1),
                                  "gib_per_s": round(mib / 1024 / median, 2)})


def get_loop(server_url: str, store, key: str) -> float:
    """The frames of `key` fetched by a plain redis-py GET loop, unchecked: the wire's own speed."""
    frame_table = store.get_frame_table(key)
    names = [f"{store.prefix}:{{{key}}}:f:{frame_table.payload_id}:{i}" for i in range(len(frame_table.frames))]
    client = redis.Redis.from_url(server_url)
    client.get(names[0])
    began = time.perf_counter()
    for name in names:
        assert client.get(name) is not None
    elapsed = time.perf_counter() - began
    client.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", default="500,1500,4000", help="state lengths, comma-separated")
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
        "redis, 1 connection, via redis-py": f"{server.url}?connections=1&wire=client",  # how every read went before
        "redis cluster, 1 connection, via redis-py": f"{cluster.url}?connections=1&wire=client",
    }
    # as a `kvrag serve` worker reads: its in-process LRU first (big enough to hold the state: a
    # hit after the first read; 1 MiB: it can never hold it, every read misses it), then Redis
    served = {
        "redis behind the hot tier (hit)": f"memory://?max_mib=1024,{server.url}",
        "redis behind the hot tier (missed)": f"memory://?max_mib=1,{server.url}",
        "redis cluster behind the hot tier (missed)": f"memory://?max_mib=1,{cluster.url}",
    }
    results: dict = {"throughput": [], "ttft": {}, "restore_ms": {}, "prefill_ms": {}, "state_tokens": {}}
    lengths = [int(t) for t in args.tokens.split(",")]
    try:
        for mib in (64, 256):
            payload = os.urandom(mib << 20)
            key = f"{mib:04x}" * 16
            arms = chunkings(payload, key)
            for name, url in tqdm(tiers.items(), desc=f"restore {mib} MiB", unit="tier"):
                store = open_store(url)
                for check, (data, chunking) in arms.items():
                    store.put(key, b"{}", data)
                    verified_restore(store, key, chunking)  # warm: page cache, connections
                    times = [verified_restore(store, key, chunking) for _ in range(args.repeat)]
                    if name == "memory":  # it checks bytes it holds once: the rows above are reads again
                        add_throughput(results, "memory, bytes read before", check, mib, times)
                        times = []
                        for _ in range(args.repeat):
                            store.put(key, b"{}", data)  # held anew: a first read, checked
                            times.append(verified_restore(store, key, chunking))
                    add_throughput(results, name, check, mib, times)
                    if check == "none" and name == "redis":
                        loops = [get_loop(server.url, store, key) for _ in range(args.repeat)]
                        add_throughput(results, name, "plain GET loop", mib, loops)
                    store.delete(key)
                store.close()
            del payload, arms

        model = load_model("smollm2-135m")
        arms_urls = {
            "memory": "memory://",
            "disk (warm)": f"disk://{tmp / 'states'}",
            "redis": server.url,
            "redis cluster": cluster.url,
            "memory, confidential": "memory://?confidential=1",
            "disk (warm), confidential": f"disk://{tmp / 'private'}?confidential=1",
            "redis, confidential": f"{server.url}?confidential=1",
            **served,
        }
        # the same tiers with the graft streamed: the forward starts once layer 0 is checked
        streamed = ("memory", "disk (warm)", "redis", "redis cluster", "redis, confidential")
        arms_urls.update({f"{name}, streamed": arms_urls[name] for name in streamed})
        for tokens in lengths:
            document = long_document(model.tokenizer, tokens)
            # each tier URL its own namespace: arms on one server never read each other's states (a
            # streamed arm reads its unstreamed twin's)
            spaces = {url: f"arm{i}" for i, url in enumerate(dict.fromkeys(arms_urls.values()))}
            engines = {name: KVEngine(model, url, signing_key=KEY, namespace=spaces[url], stream_grafts=name.endswith("streamed"))
                       for name, url in arms_urls.items()}
            refs = {name: engine.deposit(document) for name, engine in engines.items()}
            ttft: dict[str, list[float]] = {name: [] for name in ["text", *engines]}
            restore: dict[str, list[float]] = {name: [] for name in engines}
            prefill: dict[str, list[float]] = {name: [] for name in ["text", *engines]}
            hashes = set()
            for round_ in tqdm(range(args.repeat), desc=f"time to first token, {tokens} tokens", unit="round"):
                if round_ < max(1, args.repeat // 2):  # text prefill: the slow arm, fewer rounds
                    text = engines["memory"].generate(QUESTION, states=[refs["memory"]], max_new_tokens=1, graft=False, memo=False)
                    ttft["text"].append(text.receipt.timings.ttft_ms)
                    prefill["text"].append(text.receipt.timings.prefill_ms)
                    hashes.add(text.receipt.first_token_logits_sha256)
                for name, engine in engines.items():
                    graft = engine.generate(QUESTION, states=[refs[name]], max_new_tokens=1, memo=False)
                    assert graft.receipt.mode == "exact-graft", graft.receipt
                    ttft[name].append(graft.receipt.timings.ttft_ms)
                    restore[name].append(graft.receipt.timings.restore_ms)
                    prefill[name].append(graft.receipt.timings.prefill_ms)
                    hashes.add(graft.receipt.first_token_logits_sha256)
            n = refs["memory"].token_count
            results["state_tokens"][n] = tokens
            results["ttft"][n] = {name: round(statistics.median(v), 1) for name, v in ttft.items()}
            results["restore_ms"][n] = {name: round(statistics.median(v), 1) for name, v in restore.items()}
            results["prefill_ms"][n] = {name: round(statistics.median(v), 1) for name, v in prefill.items()}
            results.setdefault("logits_identical", {})[n] = len(hashes) == 1
            for engine in engines.values():
                engine.store.close()
    finally:
        server.stop()
        cluster.stop()

    print(f"\nVerified restore throughput by per-read check ({CHUNK_BYTES:,}-byte chunks), GiB/s, median of", args.repeat)
    checks = [*CHECKS, "plain GET loop"]
    for mib in (64, 256):
        print(f"\n{mib} MiB state\n\n| tier | " + " | ".join(checks) + " |\n|---|" + "---:|" * len(checks))
        for name in ["memory", "memory, bytes read before", *list(tiers)[1:]]:
            cells = {r["check"]: r for r in results["throughput"] if r["tier"] == name and r["mib"] == mib}
            print(f"| {name} | " + " | ".join(f"{cells[c]['gib_per_s']} ({cells[c]['ms']:.0f} ms)" if c in cells else "-"
                                               for c in checks) + " |")
    print(f"\nTime to first token, smollm2-135m float32, ~15-token question, median of {args.repeat} (text: of "
          f"{max(1, args.repeat // 2)}); restore / prefill ms in brackets")
    for n, t in results["ttft"].items():
        restore, prefill = results["restore_ms"][n], results["prefill_ms"][n]
        print(f"\n{n:,}-token state\n\n| arm | TTFT | restore | question forward | overlapped | arm / memory graft "
              "| text / arm |\n|---|---:|---:|---:|---:|---:|---:|")
        for name in t:
            label = "text prefill" if name == "text" else f"graft from {name}"
            overlap = max(0.0, restore.get(name, 0) + prefill[name] - t[name])
            print(f"| {label} | {t[name]:.0f} ms | {restore.get(name, 0):.0f} ms | {prefill[name]:.0f} ms | {overlap:.0f} ms | "
                  f"{t[name] / t['memory']:.2f}x | {t['text'] / t[name]:.1f}x |")
        print(f"\nfirst-token logits identical in every arm: {'yes' if results['logits_identical'][n] else 'NO'}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
