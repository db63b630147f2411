"""What a deposit costs the answers beside it, on a real `kvrag serve` (loopback, its own memory store).

Warm clients ask the bundled questions over documents already deposited (grafts, `max_tokens`
16, streaming) from `--clients` concurrent clients, in three phases of the same requests:

  1. quiet: the warm clients alone;
  2. cold reads: one more client asks about new documents (each read as text), `deposit: false`;
  3. cold reads and deposits: the same, `deposit: true` (the server's default): each new document
     is deposited after its answer, on the server's deposit worker.

The warm clients' TTFT in phase 3 against phase 2 is what the deposits added (the cold reads
themselves are in both). Prints one Markdown row per phase and the ratios; one run, one machine.

    python benchmarks/deposit_under_load.py [--clients 4] [--repeat 2] [--model smollm2-135m] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from kvrag.testing import KVRagServer

sys.path.insert(0, str(Path(__file__).parent))
from serve import _pct, one, workload  # noqa: E402 (the serve benchmark's client)


async def _phase(url: str, model: str, clients: int, items: list[tuple[str, str]], cold: list[tuple[str, str]],
                 deposit: bool) -> dict:
    """The warm `items` from `clients` clients, beside one client asking the `cold` ones (if any)."""
    gate = asyncio.Semaphore(clients)
    warm: list = []
    cold_done: list = []
    finished = asyncio.Event()
    limits = httpx.Limits(max_connections=clients * 2 + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10), limits=limits) as h:
        async def ask(question: str, doc: str) -> None:
            async with gate:
                warm.append(await one(h, url, model, question, doc, 16, {"memo": False}))

        async def cold_client() -> None:
            for question, doc in cold:
                if finished.is_set():
                    return
                cold_done.append(await one(h, url, model, question, doc, 1, {"memo": False, "deposit": deposit}))

        began = time.perf_counter()
        beside = asyncio.create_task(cold_client()) if cold else None
        await asyncio.gather(*(ask(q, d) for q, d in items))
        wall = time.perf_counter() - began
        finished.set()
        if beside is not None:
            await beside
    ttfts = sorted(r.ttft_s for r in warm if r.status == 200 and r.ttft_s is not None)
    return {"answers": len(ttfts), "failed": sum(r.status != 200 for r in warm), "wall_s": wall,
            "answers_per_s": len(ttfts) / wall, "ttft_p50_ms": _pct(ttfts, 50) * 1e3, "ttft_p99_ms": _pct(ttfts, 99) * 1e3,
            "modes": sorted({r.mode for r in warm}), "cold_asked": len(cold_done)}


def _cold(items: list[tuple[str, str]], count: int) -> list[tuple[str, str]]:
    """`count` documents never seen: the bundled ones, each with a line of its own at the end."""
    return [(question, f"{doc}\nCatalogued as item {uuid.uuid4().hex[:12]}.")
            for question, doc in (items * (count // len(items) + 1))[:count]]


async def _main(args: argparse.Namespace) -> list[dict]:
    folder = Path(tempfile.mkdtemp(prefix="kvrag-deposit-load-"))
    server = KVRagServer(args.model, "memory://", log=folder / "serve.log").start(timeout=300)
    try:
        items = workload(args.repeat)
        async with httpx.AsyncClient(timeout=300) as h:  # the deposit pass: every warm document stored
            for question, doc in workload(1):
                await one(h, server.url, args.model, question, doc, 1, {})
            for _ in range(120):  # until the deposit worker has nothing left
                if (await h.get(server.base + "/health")).json()["deposits"]["pending_bytes"] == 0:
                    break
                await asyncio.sleep(1)
        rows = []
        for label, cold, deposit in (("quiet", [], False), ("cold reads", _cold(items, 200), False),
                                     ("cold reads and deposits", _cold(items, 200), True)):
            row = await _phase(server.url, args.model, args.clients, items, cold, deposit)
            rows.append({"phase": label, **row})
            print(f"{label}: {row}", file=sys.stderr)
        health = httpx.get(server.base + "/health").json()
        rows[-1]["deposits"] = health.get("deposits")
        return rows
    finally:
        server.stop(kill=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2, help="passes over the bundled questions per phase")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    rows = asyncio.run(_main(args))
    print("| phase | warm answers | answers/s | TTFT p50 / p99 ms | cold questions beside |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['phase']} | {r['answers']} | {r['answers_per_s']:.2f} | {r['ttft_p50_ms']:.0f} / "
              f"{r['ttft_p99_ms']:.0f} | {r['cold_asked']} |")
    base, deposits = rows[1], rows[2]
    print(f"\nwhat the deposits added: TTFT p50 x{deposits['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}, "
          f"p99 x{deposits['ttft_p99_ms'] / base['ttft_p99_ms']:.2f}, answers/s "
          f"x{deposits['answers_per_s'] / base['answers_per_s']:.2f}; deposits: {rows[2].get('deposits')}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
