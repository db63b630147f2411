"""`kvrag serve` under load, on loopback: a concurrency sweep, then faults.

Starts its own Redis (and a 3-master Redis Cluster) on free ports and `kvrag serve` processes in
front of them, then sends the bundled questions (each with its document, in the `kvrag` request
field) from N concurrent streaming clients:

  1. a deposit pass (the first ask of each document reads it as text and deposits its state);
  2. per concurrency level, a text arm (`graft: false`: plain text RAG, same tokens) and a graft
     arm (`memo: false`, so grafting is what is measured), with throughput (answers and generated
     tokens per second), client-side TTFT p50/p99, receipt modes and where each graft came from
     (the worker's own hot tier, or the shared store: a state another worker deposited or this
     one evicted), and how many answers differ from the same request's answer served alone;
  3. faults, on 2 workers over Redis: one worker restarted mid-run (SIGTERM; uvicorn starts a new
     one), clients going away mid-stream, and Redis killed mid-run. Every request is counted:
     status, mode, reason, and whether its answer equals its solo answer.

Setups (`--only`): `redis1` (one worker, the defaults: its generations' decoding steps batched),
`today` (one worker, `--no-batch --concurrency 1`: each answer's steps alone, one at a time, as
before batching), `redis2` (two workers, then the faults), `cluster`, and `vllm` (vLLM's OpenAI
server from `make peer-env`, prefix caching on, the same model folder and the same prompt token
ids, sent to /v1/completions).

Bounded: every request has a timeout, every run a fixed number of requests. Times are one run on
one shared machine: compare the ratios.

    python benchmarks/serve.py [--concurrency 1,2,4,8,16] [--max-tokens 16] [--only redis1,today,vllm]
                               [--json out.json] [--plot serve.png]
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
    tokens: int = 0
    text: str = ""
    key: tuple[str, str] = ("", "")


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

    def row(self, solo: dict[tuple[str, str], str] | None = None) -> dict:
        ttfts = sorted(r.ttft_s for r in self.ok)
        grafted = [t for r in self.ok for t in r.tiers]
        return {
            "label": self.label, "workers": self.workers, "concurrency": self.concurrency,
            "requests": self.requests, "failed": sum(r.status not in (200, 499) for r in self.results),
            "clients_gone": sum(r.status == 499 for r in self.results),
            "statuses": dict(Counter(r.status for r in self.results)),
            "throughput_rps": len(self.ok) / self.wall_s if self.wall_s else 0.0,
            "tokens_per_s": sum(r.tokens for r in self.ok) / self.wall_s if self.wall_s else 0.0,
            "unlike_solo": None if not solo else sum(r.key in solo and r.text != solo[r.key] for r in self.ok),
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
              kv: dict, leave_after: int | None = None) -> Result:
    """One streaming request; `leave_after`: the client goes away after that many chunks."""
    if "prompt" in kv:  # a peer's /v1/completions, fed the same token ids
        body = {"model": model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                "prompt": kv["prompt"][(question, doc)], "temperature": 0}
        path = "/completions"
    else:
        body = {"model": model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": question}], "kvrag": {"documents": [doc], **kv}}
        path = "/chat/completions"
    began = time.perf_counter()
    chunks = 0
    try:
        async with h.stream("POST", url + path, json=body) as response:
            result = Result(response.status_code, worker=response.headers.get("x-kvrag-worker"), key=(question, doc))
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
                for choice in chunk.get("choices") or []:
                    result.text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    result.status = 499  # the client went away (nginx's code for it)
                    break
                receipt = chunk.get("kvrag_receipt")
                if receipt:
                    result.mode = receipt["mode"]
                    result.reasons = [s["reason"] for s in receipt["states"] if s.get("reason")]
                    result.tiers = [s["tier"].split("://")[0] for s in receipt["states"] if s["source"] == "graft"]
                if chunk.get("usage"):
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                    result.tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError:
        return Result(0, total_s=time.perf_counter() - began)
    result.total_s = time.perf_counter() - began
    return result


async def run_arm(label: str, url: str, model: str, workers: int, concurrency: int, max_tokens: int,
                  kv: dict, items: list[tuple[str, str]], during=None, leaving: int = 0) -> Arm:
    """`items` from `concurrency` clients; `during(answers so far)` is called after each one (faults);
    with `leaving`, every `leaving`-th client goes away after its second chunk."""
    gate = asyncio.Semaphore(concurrency)
    done: list[Result] = []

    # a new connection per request, as an HTTP load balancer spreads requests: a kept-alive
    # connection stays with the worker that accepted it, however busy that worker is
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10),
                                 limits=httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=0)) as h:
        async def client(index: int, question: str, doc: str) -> Result:
            async with gate:
                leave = 2 if leaving and index % leaving == leaving - 1 else None
                result = await one(h, url, model, question, doc, max_tokens, kv, leave)
                done.append(result)
                if during is not None:
                    await during(done)
                return result

        began = time.perf_counter()
        results = await asyncio.gather(*[client(i, q, d) for i, (q, d) in enumerate(items)])
        wall = time.perf_counter() - began
    return Arm(label, workers, concurrency, len(items), wall, list(results))


#: each setup's answers served alone (its text arm at one client), by (question, document)
SOLO: dict[str, dict[tuple[str, str], str]] = {}


def solo_for(label: str) -> dict[tuple[str, str], str] | None:
    return SOLO.get(label) or SOLO.get(label.rsplit(": ", 1)[0])


def show(arm: Arm) -> None:
    r = arm.row(solo_for(arm.label))
    p50 = f"{r['ttft_p50_s'] * 1e3:.0f}" if r["ttft_p50_s"] is not None else "-"
    p99 = f"{r['ttft_p99_s'] * 1e3:.0f}" if r["ttft_p99_s"] is not None else "-"
    modes = ", ".join(f"{m} {n}" for m, n in r["modes"].items()) or "-"
    shared = f"{r['grafts_from_shared_store']}/{r['grafts']}" if r["grafts"] else "-"
    unlike = "-" if r["unlike_solo"] is None else r["unlike_solo"]
    print(f"| {r['label']} | {r['workers']} ({r['workers_seen']} answered) | {r['concurrency']} | {r['requests']} | "
          f"{r['failed']} | {r['throughput_rps']:.2f} | {r['tokens_per_s']:.1f} | {p50} | {p99} | {modes} | {shared} | "
          f"{unlike} |", flush=True)


HEADER = ("| run | workers | clients | requests | failed | answers/s | tokens/s | TTFT p50 ms | TTFT p99 ms | "
          "receipt modes | grafts from the shared store | answers unlike solo |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def items_for(level: int) -> list[tuple[str, str]]:
    """The bundled questions, repeated so that every client asks at least two."""
    items = workload()
    return workload(max(1, -(-2 * level // len(items))))


def sweep_url(label: str, url: str, model: str, workers: int, args, arms: list[Arm], kvs: dict[str, dict]) -> None:
    """The deposit (or warming) pass, then each level's arms; the first level's text arm is the solo reference."""
    arms.append(asyncio.run(run_arm(f"{label}: deposit pass", url, model, workers, max(args.levels), args.max_tokens,
                                    kvs["deposit"], workload())))
    show(arms[-1])
    _deposits_settled(url.removesuffix("/v1"))
    for level in args.levels:
        for arm in ("text", "graft"):
            if arm not in kvs:
                continue
            arms.append(asyncio.run(run_arm(f"{label}: {arm}", url, model, workers, level, args.max_tokens, kvs[arm],
                                            items_for(level))))
            if level == 1 and label not in SOLO:
                SOLO[label] = {r.key: r.text for r in arms[-1].ok}
            show(arms[-1])


def _deposits_settled(base: str, timeout: float = 180) -> None:
    """Wait until the deposit workers have nothing queued (a deposit runs in the batch's idle time:
    the arms measure grafting, not deposits still draining). A peer has no such report: no wait."""
    deadline, quiet = time.monotonic() + timeout, 0
    while time.monotonic() < deadline and quiet < 3:  # three answers in a row: every worker, likely
        try:
            deposits = httpx.get(base + "/health", timeout=5).json().get("deposits")
        except (httpx.HTTPError, ValueError):
            return
        if deposits is None:
            return
        quiet = quiet + 1 if deposits.get("pending_bytes", 0) == 0 else 0
        time.sleep(0.5)


KVRAG_ARMS = {"deposit": {"memo": False}, "text": {"graft": False}, "graft": {"memo": False}}


def sweep(label: str, store_url: str, workers: int, args, tmp: Path, arms: list[Arm],
          extra: tuple[str, ...] = ()) -> KVRagServer:
    server = KVRagServer(args.model, store_url, ("--workers", str(workers), *extra), log=tmp / f"serve-{len(arms)}.log")
    server.start(timeout=300)
    sweep_url(label, server.url, args.model, workers, args, arms, KVRAG_ARMS)
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--only", default="redis1,today,redis2,cluster,faults")
    parser.add_argument("--peer-python", default=".venv-peer/bin/python", help="the vLLM environment (`make peer-env`)")
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
    print(f"model {args.model}, {len(workload())} questions per pass (repeated so each client asks two), "
          f"max_tokens {args.max_tokens}, {os.cpu_count()} cores ({_cpu()}), logs in {tmp}\n\n{HEADER}", flush=True)

    for name, label, workers, extra in (("redis1", "1 worker, Redis, batched (the defaults)", 1, ()),
                                        ("today", "1 worker, Redis, --no-batch --concurrency 1", 1,
                                         ("--no-batch", "--concurrency", "1")),
                                        ("redis2", "2 workers, Redis, batched", 2, ())):
        if name not in only:
            continue
        redis = RedisServer(tmp / f"redis-{name}").start()
        server = sweep(label, redis.url, workers, args, tmp, arms, extra)
        if name == "redis2" and "faults" in only:
            faults(server, redis, args, arms)
        server.stop()
        redis.stop()
    if "cluster" in only:
        cluster = RedisCluster(tmp / "cluster").start()
        sweep("2 workers, Redis Cluster, batched", cluster.url, 2, args, tmp, arms).stop()
        cluster.stop()
    if "vllm" in only:
        vllm(args, tmp, arms)

    if args.json_path:
        Path(args.json_path).write_text(json.dumps(
            [{**a.row(solo_for(a.label)), "results": [_public(r) for r in a.results]} for a in arms],
            indent=2))
    if args.plot_path:
        plot([a.row() for a in arms], args.plot_path)


def _public(result: Result) -> dict:
    """A result as the JSON keeps it: its question, not the document it came with."""
    row = asdict(result)
    row["question"] = row.pop("key")[0]
    return row


def _cpu() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return f"{name}, {'AVX512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'no AVX2'}"


def vllm(args, tmp: Path, arms: list[Arm]) -> None:
    """vLLM's OpenAI server on the same model folder, fed the token ids kvrag's server reads."""
    import subprocess

    from kvrag import KVEngine, MemoryStore, load_model
    from kvrag.models.loading import GGUF_MODELS, embedded_folder
    from kvrag.testing import free_port

    if not Path(args.peer_python).exists():
        raise SystemExit(f"{args.peer_python} not found: run `make peer-env` first")
    engine = KVEngine(load_model(args.model), MemoryStore())
    prompts = {}
    for question, doc in workload():
        segments = engine.plan([doc])
        prompts[(question, doc)] = [i for s in segments for i in s.ids] + engine.planner.question(question, segments)
    folder, port = str(embedded_folder(GGUF_MODELS[args.model])), free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"}
    log = open(tmp / "vllm.log", "w")
    process = subprocess.Popen([args.peer_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                                "--served-model-name", args.model, "--dtype", "float32", "--enable-prefix-caching",
                                "--max-model-len", "4096", "--seed", "0", "--host", "127.0.0.1", "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            raise SystemExit(f"vLLM's server did not start; see {tmp / 'vllm.log'}")
        # its warming pass puts every prompt in its prefix cache: the arm then measures warm prefix hits
        sweep_url("vLLM-CPU OpenAI server, prefix caching", f"http://127.0.0.1:{port}/v1", args.model, 1, args, arms,
                  {"deposit": {"prompt": prompts}, "graft": {"prompt": prompts}})
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)


def faults(server: KVRagServer, redis: RedisServer, args, arms: list[Arm]) -> None:
    """A worker restarted, clients going away mid-stream, then Redis killed, each a third of the way
    into a graft run; every answer is compared with the same request's answer alone."""
    items = workload(2)
    level = max(args.levels)
    label = "2 workers, Redis, batched"
    before = {r.worker for a in arms for r in a.results}
    stopped: list[str] = []

    async def restart_one(done: list[Result]) -> None:
        if len(done) == len(items) // 3 and not stopped and done[-1].worker:
            stopped.append(done[-1].worker)
            os.kill(int(done[-1].worker), signal.SIGTERM)  # graceful: it finishes what it holds; uvicorn starts another

    arms.append(asyncio.run(run_arm(f"{label}: a worker restarted mid-run", server.url, args.model, 2, level,
                                    args.max_tokens, {"memo": False}, items, restart_one)))
    show(arms[-1])
    fresh = [r for r in arms[-1].results if r.worker not in before]
    print(f"worker {stopped} restarted; its replacement answered {len(fresh)} requests, grafted from "
          f"{dict(Counter(t for r in fresh for t in r.tiers))}, modes {dict(Counter(r.mode for r in fresh))}", flush=True)

    arms.append(asyncio.run(run_arm(f"{label}: every 4th client goes away after 2 chunks", server.url, args.model, 2,
                                    level, args.max_tokens, {"memo": False}, items, leaving=4)))
    show(arms[-1])

    # documents no tier holds yet, each asked twice: a deposit, then a graft, until Redis goes
    revised = [(q, d + " (revised edition)") for q, d in workload()]
    revised = [pair for pair in revised for _ in range(2)]

    async def kill_redis(done: list[Result]) -> None:
        if len(done) == len(revised) // 3:
            redis.stop(kill=True)

    killed = f"{label}: Redis killed mid-run"
    arms.append(asyncio.run(run_arm(killed, server.url, args.model, 2, level, args.max_tokens, {"memo": False},
                                    revised, kill_redis)))
    # each of its requests again, alone, afterwards (by text, or from the workers' own hot tiers): the solo answers
    alone = asyncio.run(run_arm(f"{killed}, each alone afterwards", server.url, args.model, 2, 1, args.max_tokens,
                                {"memo": False}, list(dict.fromkeys(revised))))
    SOLO[killed] = {r.key: r.text for r in alone.ok}
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
            if not chosen:
                continue
            xs = [r["concurrency"] for r in chosen]
            left.plot(xs, [r["ttft_p50_s"] * 1e3 for r in chosen], style, color=colour, marker="o", label=f"{setup}, {arm}")
            right.plot(xs, [r["throughput_rps"] for r in chosen], style, color=colour, marker="o")
    left.set(xlabel="concurrent clients", ylabel="TTFT p50 (ms)", title="time to first token (client side)")
    right.set(xlabel="concurrent clients", ylabel="answers / s", title="throughput")
    left.set_yscale("log")
    for axis in (left, right):
        axis.set_xticks(sorted({r["concurrency"] for r in rows}))
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
