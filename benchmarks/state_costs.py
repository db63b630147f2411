"""What a state costs to keep: bytes per token for every model and dtype kvrag ships, a corpus's
cost in Redis memory and on disk, and what lossless compression would save (measured here, not
used by any store).

For each model and dtype one document of about 500 tokens is deposited into a disk store and into
a throwaway redis-server (started here, on a free port): the payload's size comes from the signed
manifest, the disk cost from the files the store wrote, the Redis cost from `INFO memory`
(`used_memory` before and after, so the frames' and records' overhead is included). Corpus costs
scale those measured per-state figures (every document about 500 tokens). Compression is zstd
(level 1 and 3) over the payload as it is and byte-shuffled (byte i of every float together),
with its ratio and single-thread speeds.

    python benchmarks/state_costs.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import blosc2
import numpy as np
import redis
import zstandard
from tqdm import tqdm

from kvrag import DiskStore, KVEngine, load_model
from kvrag.artifacts.format import parse_manifest
from kvrag.data import long_document
from kvrag.testing import RedisServer

RUNS = [("smollm2-135m", "float32"), ("smollm2-135m", "bfloat16"), ("gemma3-270m", "float32"), ("gemma3-270m", "bfloat16")]
CORPORA = (10_000, 1_000_000)
MIB, GIB = 2**20, 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=500, help="document size in tokens")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    rows = [measure(name, dtype, args.tokens) for name, dtype in tqdm(RUNS, desc="state costs", unit="model")]
    print_tables(rows)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2))


def measure(name: str, dtype: str, tokens: int) -> dict:
    model = load_model(name, dtype=dtype)
    document = long_document(model.tokenizer, tokens)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        disk = KVEngine(model, DiskStore(folder / "disk"))
        ref = disk.deposit(document)
        manifest = parse_manifest(disk.store.read_manifest(ref.key))
        disk_bytes = sum(f.stat().st_size for f in (folder / "disk").rglob("*") if f.is_file())
        payload = bytes(disk.store.read(ref.key).payload)
        server = RedisServer(folder / "redis").start()
        try:
            client = redis.Redis(port=server.port)
            before = int(client.info("memory")["used_memory"])
            KVEngine(model, server.url).deposit(document)
            redis_bytes = int(client.info("memory")["used_memory"]) - before
            restore = effective_restore(payload, 2 if dtype == "bfloat16" else 4, client, folder / "speed")
            client.close()
        finally:
            server.stop()
    itemsize = 2 if dtype == "bfloat16" else 4
    return {
        "model": name, "dtype": dtype, "tokens": ref.token_count, "payload_bytes": manifest.payload_bytes,
        "bytes_per_token": manifest.payload_bytes / ref.token_count, "disk_bytes": disk_bytes,
        "redis_bytes": redis_bytes, "compression": compression(payload, itemsize), "restore": restore,
    }


CHUNK = 8 << 20


def _pack(chunk: bytes, itemsize: int) -> bytes:
    """blosc2: byte shuffle and zstd-1 in one C pass (the ratio of the table above's shuffled zstd-1)."""
    return blosc2.compress2(chunk, typesize=itemsize, codec=blosc2.Codec.ZSTD, clevel=1, filter=blosc2.Filter.SHUFFLE)


def _unpack(packed: bytes, itemsize: int) -> bytes:
    return blosc2.decompress2(packed)


def effective_restore(payload: bytes, itemsize: int, client: redis.Redis, folder: Path, repeat: int = 5) -> dict:
    """Plaintext GiB/s of a restore from each tier, plain and shuffled+zstd-1 (blosc2, one thread) per
    8 MiB chunk (each chunk decompressed on a second thread while the next one is read), medians of
    `repeat`."""
    from concurrent.futures import ThreadPoolExecutor

    usable = len(payload) // itemsize * itemsize
    chunks = [payload[i : i + CHUNK] for i in range(0, usable, CHUNK)]
    packed = [_pack(c, itemsize) for c in chunks]
    assert all(_unpack(z, itemsize) == c for z, c in zip(packed, chunks))
    folder.mkdir(parents=True, exist_ok=True)
    for i, (c, z) in enumerate(zip(chunks, packed)):
        client.set(f"raw:{i}", c)
        client.set(f"zstd:{i}", z)
        (folder / f"raw{i}").write_bytes(c)
        (folder / f"zstd{i}").write_bytes(z)
    blosc2.set_nthreads(1)
    pool = ThreadPoolExecutor(1)
    readers = {"redis": lambda name: client.get(name), "disk": lambda name: (folder / name.replace(":", "")).read_bytes()}
    size = sum(len(c) for c in chunks)
    figures = {}
    for tier, read in readers.items():
        for kind in ("raw", "zstd"):
            times = []
            for _ in range(repeat):
                began = time.perf_counter()
                jobs = []
                for i in range(len(chunks)):
                    data = read(f"{kind}:{i}")
                    if kind == "zstd":
                        jobs.append(pool.submit(_unpack, data, itemsize))
                for job in jobs:
                    job.result()
                times.append(time.perf_counter() - began)
            figures[f"{tier}-{kind}"] = size / GIB / sorted(times)[len(times) // 2]
    pool.shutdown()
    return figures


def compression(payload: bytes, itemsize: int) -> dict:
    data = np.frombuffer(payload, dtype=np.uint8)
    shuffled = data[: len(data) // itemsize * itemsize].reshape(-1, itemsize).T.copy().tobytes()
    figures = {}
    for label, raw in (("plain", payload), ("shuffled", shuffled)):
        for level in (1, 3):
            compressor, decompressor = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
            began = time.perf_counter()
            packed = compressor.compress(raw)
            packed_s = time.perf_counter() - began
            began = time.perf_counter()
            assert decompressor.decompress(packed) == raw
            unpacked_s = time.perf_counter() - began
            figures[f"{label}-zstd{level}"] = {"ratio": len(raw) / len(packed), "compress_gib_s": len(raw) / GIB / packed_s,
                                               "decompress_gib_s": len(raw) / GIB / unpacked_s}
    return figures


def print_tables(rows: list[dict]) -> None:
    print("\n| model | dtype | state tokens | payload | bytes per token | on disk | in Redis |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['dtype']} | {r['tokens']} | {r['payload_bytes'] / MIB:.1f} MiB | "
              f"{r['bytes_per_token'] / 1024:.1f} KiB | {r['disk_bytes'] / MIB:.1f} MiB | {r['redis_bytes'] / MIB:.1f} MiB |")
    print("\n| model | dtype | " + " | ".join(f"{n:,} documents: Redis / disk" for n in CORPORA) + " |")
    print("|---|---|" + "---:|" * len(CORPORA))
    for r in rows:
        cells = [f"{_size(n * r['redis_bytes'])} / {_size(n * r['disk_bytes'])}" for n in CORPORA]
        print(f"| {r['model']} | {r['dtype']} | " + " | ".join(cells) + " |")
    print("\n| model | dtype | zstd-1 ratio (plain / shuffled) | zstd-3 ratio (plain / shuffled) "
          "| shuffled zstd-1 compress / decompress |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        c = r["compression"]
        print(f"| {r['model']} | {r['dtype']} | {c['plain-zstd1']['ratio']:.2f} / {c['shuffled-zstd1']['ratio']:.2f} | "
              f"{c['plain-zstd3']['ratio']:.2f} / {c['shuffled-zstd3']['ratio']:.2f} | "
              f"{c['shuffled-zstd1']['compress_gib_s']:.2f} / {c['shuffled-zstd1']['decompress_gib_s']:.2f} GiB/s |")
    print("\nRestore speed with and without shuffled zstd-1 (blosc2; plaintext GiB/s: a plain GET loop / warm file "
          "reads, each compressed chunk decompressed on a second thread while the next is read)")
    print("\n| model | dtype | Redis: plain / compressed | disk: plain / compressed |\n|---|---|---:|---:|")
    for r in rows:
        f = r["restore"]
        print(f"| {r['model']} | {r['dtype']} | {f['redis-raw']:.2f} / {f['redis-zstd']:.2f} | "
              f"{f['disk-raw']:.2f} / {f['disk-zstd']:.2f} |")


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:,.0f} GiB" if nbytes < 1024 * GIB else f"{nbytes / GIB / 1024:,.1f} TiB"


if __name__ == "__main__":
    main()
