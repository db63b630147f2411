"""`kvrag serve` under load, on loopback: a concurrency sweep, then faults.

Starts its own Redis (and a 3-master Redis Cluster) on free ports and `kvrag serve` processes in
front of them, then sends the bundled questions (each with its document, in the `kvrag` request
field) from N concurrent streaming clients:

  1. a deposit pass (the first ask of each document reads it as text and deposits its state);
  2. per concurrency level, a text arm (`graft: false`: plain text RAG, same tokens) and a graft
     arm (`memo: false`, so grafting is what is measured), with throughput, client-side TTFT
     p50/p99, receipt modes and where each graft came from (the worker's own hot tier, or the
     shared store: a state another worker deposited or this one evicted);
  3. faults, on 2 workers over Redis: one worker restarted mid-run (SIGTERM; uvicorn starts a new
     one) and Redis killed mid-run. Every request is counted: status, mode, reason.

Bounded: every request has a timeout, every run a fixed number of requests. Times are one run on
one shared machine: compare the ratios.

    python benchmarks/serve.py [--concurrency 1,2,4] [--max-tokens 16] [--json out.json] [--plot serve.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvrag.data import sample_docs, sample_questions
from kvrag.testing import KVRagServer, RedisCluster, RedisServer


@dataclass
class Result:
    status: int
    ttft_s: float | None = None
    total_s: float = 0.0
    mode: str | None = None
    reasons: list[str] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    worker: str | None = None
    cached_tokens: int = 0


@dataclass
class Arm:
    label: str
    workers: int
    concurrency: int
    requests: int
    wall_s: float
    results: list[Result]

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.status == 200 and r.ttft_s is not None]

    def row(self) -> dict:
        ttfts = sorted(r.ttft_s for r in self.ok)
        grafted = [t for r in self.ok for t in r.tiers]
        return {
            "label": self.label, "workers": self.workers, "concurrency": self.concurrency,
            "requests": self.requests, "failed": sum(r.status != 200 for r in self.results),
            "statuses": dict(Counter(r.status for r in self.results)),
            "throughput_rps": len(self.ok) / self.wall_s if self.wall_s else 0.0,
            "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
            "modes": dict(Counter(r.mode for r in self.ok)),
            "reasons": dict(Counter(x for r in self.ok for x in r.reasons)),
            "grafts_from_shared_store": sum(t != "memory" for t in grafted),
            "grafts": len(grafted),
            "workers_seen": len({r.worker for r in self.ok}),
        }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def workload(repeat: int = 1) -> list[tuple[str, str]]:
    docs = {d.id: d.text for d in sample_docs()}
    return [(q.question, docs[q.doc_id]) for q in sample_questions() if q.doc_id in docs] * repeat


async def one(h: httpx.AsyncClient, url: str, model: str, question: str, doc: str, max_tokens: int,
              kv: dict) -> Result:
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": question}], "kvrag": {"documents": [doc], **kv}}
    began = time.perf_counter()
    try:
        async with h.stream("POST", url + "/chat/completions", json=body) as response:
            result = Result(response.status_code, worker=response.headers.get("x-kvrag-worker"))
            if response.status_code != 200:
                await response.aread()
                result.total_s = time.perf_counter() - began
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.status = 599
                    continue
                if result.ttft_s is None and chunk.get("choices"):
                    result.ttft_s = time.perf_counter() - began
                receipt = chunk.get("kvrag_receipt")
                if receipt:
                    result.mode = receipt["mode"]
                    result.reasons = [s["reason"] for s in receipt["states"] if s.get("reason")]
                    result.tiers = [s["tier"].split("://")[0] for s in receipt["states"] if s["source"] == "graft"]
                if chunk.get("usage"):
                    result.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    except httpx.HTTPError:
        return Result(0, total_s=time.perf_counter() - began)
    result.total_s = time.perf_counter() - began
    return result


async def run_arm(label: str, server: KVRagServer, model: str, workers: int, concurrency: int, max_tokens: int,
                  kv: dict, items: list[tuple[str, str]], during=None) -> Arm:
    """`items` from `concurrency` clients; `during(answers so far)` is called after each one (faults)."""
    gate = asyncio.Semaphore(concurrency)
    done: list[Result] = []

    # a new connection per request, as an HTTP load balancer spreads requests: a kept-alive
    # connection stays with the worker that accepted it, however busy that worker is
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10),
                                 limits=httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=0)) as h:
        async def client(question: str, doc: str) -> Result:
            async with gate:
                result = await one(h, server.url, model, question, doc, max_tokens, kv)
                done.append(result)
                if during is not None:
                    await during(done)
                return result

        began = time.perf_counter()
        results = await asyncio.gather(*[client(q, d) for q, d in items])
        wall = time.perf_counter() - began
    return Arm(label, workers, concurrency, len(items), wall, list(results))


def show(arm: Arm) -> None:
    r = arm.row()
    p50 = f"{r['ttft_p50_s'] * 1e3:.0f}" if r["ttft_p50_s"] is not None else "-"
    p99 = f"{r['ttft_p99_s'] * 1e3:.0f}" if r["ttft_p99_s"] is not None else "-"
    modes = ", ".join(f"{m} {n}" for m, n in r["modes"].items())
    shared = f"{r['grafts_from_shared_store']}/{r['grafts']}" if r["grafts"] else "-"
    print(f"| {r['label']} | {r['workers']} ({r['workers_seen']} answered) | {r['concurrency']} | {r['requests']} | "
          f"{r['failed']} | {r['throughput_rps']:.2f} | {p50} | {p99} | {modes} | {shared} |", flush=True)


HEADER = ("| run | workers | clients | requests | failed | answers/s | TTFT p50 ms | TTFT p99 ms | receipt modes | "
          "grafts from the shared store |\n|---|---|---|---|---|---|---|---|---|---|")


def sweep(label: str, store_url: str, workers: int, args, tmp: Path, arms: list[Arm]) -> KVRagServer:
    server = KVRagServer(args.model, store_url, ("--workers", str(workers)), log=tmp / f"serve-{len(arms)}.log")
    server.start(timeout=300)
    items = workload()
    arms.append(asyncio.run(run_arm(f"{label}: deposit pass", server, args.model, workers, max(args.levels),
                                    args.max_tokens, {"memo": False}, items)))
    show(arms[-1])
    for level in args.levels:
        for arm, kv in (("text", {"graft": False}), ("graft", {"memo": False})):
            arms.append(asyncio.run(run_arm(f"{label}: {arm}", server, args.model, workers, level, args.max_tokens,
                                            kv, items)))
            show(arms[-1])
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", default="1,2,4")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--only", default="redis1,redis2,cluster,faults")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    parser.add_argument("--replot", metavar="JSON", help="only draw --plot from an earlier run's --json")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), args.plot_path or "serve.png")
        return
    args.levels = [int(x) for x in args.concurrency.split(",")]
    only = set(args.only.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="kvrag-serve-bench-"))
    arms: list[Arm] = []
    print(f"model {args.model}, {len(workload())} questions per arm, max_tokens {args.max_tokens}, "
          f"{os.cpu_count()} cores, logs in {tmp}\n\n{HEADER}", flush=True)

    for name, workers in (("redis1", 1), ("redis2", 2)):
        if name not in only:
            continue
        redis = RedisServer(tmp / f"redis-{name}").start()
        server = sweep(f"{workers} worker{'s' * (workers > 1)}, Redis", redis.url, workers, args, tmp, arms)
        if name == "redis2" and "faults" in only:
            faults(server, redis, args, arms)
        server.stop()
        redis.stop()
    if "cluster" in only:
        cluster = RedisCluster(tmp / "cluster").start()
        sweep("2 workers, Redis Cluster", cluster.url, 2, args, tmp, arms).stop()
        cluster.stop()

    if args.json_path:
        Path(args.json_path).write_text(json.dumps([{**a.row(), "results": [asdict(r) for r in a.results]}
                                                    for a in arms], indent=2))
    if args.plot_path:
        plot([a.row() for a in arms], args.plot_path)


def faults(server: KVRagServer, redis: RedisServer, args, arms: list[Arm]) -> None:
    """A worker restarted, then Redis killed, each a third of the way into a graft run."""
    items = workload(2)
    level = max(args.levels)
    before = {r.worker for a in arms for r in a.results}
    stopped: list[str] = []

    async def restart_one(done: list[Result]) -> None:
        if len(done) == len(items) // 3 and not stopped and done[-1].worker:
            stopped.append(done[-1].worker)
            os.kill(int(done[-1].worker), signal.SIGTERM)  # graceful: it finishes what it holds; uvicorn starts another

    arms.append(asyncio.run(run_arm("2 workers, Redis: a worker restarted mid-run", server, args.model, 2, level,
                                    args.max_tokens, {"memo": False}, items, restart_one)))
    show(arms[-1])
    fresh = [r for r in arms[-1].results if r.worker not in before]
    print(f"worker {stopped} restarted; its replacement answered {len(fresh)} requests, grafted from "
          f"{dict(Counter(t for r in fresh for t in r.tiers))}, modes {dict(Counter(r.mode for r in fresh))}", flush=True)

    # documents no tier holds yet, each asked twice: a deposit, then a graft, until Redis goes
    revised = [(q, d + " (revised edition)") for q, d in workload()]
    revised = [pair for pair in revised for _ in range(2)]

    async def kill_redis(done: list[Result]) -> None:
        if len(done) == len(revised) // 3:
            redis.stop(kill=True)

    arms.append(asyncio.run(run_arm("2 workers, Redis killed mid-run", server, args.model, 2, level,
                                    args.max_tokens, {"memo": False}, revised, kill_redis)))
    show(arms[-1])
    print(f"text fallbacks by reason: {arms[-1].row()['reasons']}", flush=True)


def plot(rows: list[dict], path: str) -> None:
    """TTFT p50 and throughput against clients: one colour per setup, dashed text, solid graft."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    setups = sorted({r["label"].rsplit(": ", 1)[0] for r in rows if r["label"].endswith((": text", ": graft"))})
    for colour, setup in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], setups):
        for arm, style in (("text", "--"), ("graft", "-")):
            chosen = [r for r in rows if r["label"] == f"{setup}: {arm}"]
            xs = [r["concurrency"] for r in chosen]
            left.plot(xs, [r["ttft_p50_s"] * 1e3 for r in chosen], style, color=colour, marker="o", label=f"{setup}, {arm}")
            right.plot(xs, [r["throughput_rps"] for r in chosen], style, color=colour, marker="o")
    left.set(xlabel="concurrent clients", ylabel="TTFT p50 (ms)", title="time to first token (client side)")
    right.set(xlabel="concurrent clients", ylabel="answers / s", title="throughput")
    for axis in (left, right):
        axis.set_xticks(sorted({r["concurrency"] for r in rows}))
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
