"""Test helpers for kvrag and for your own tests: throwaway real Redis servers and kvrag servers.

`RedisServer` starts one `redis-server` on a free loopback port, `RedisCluster` a 3-master cluster
(with AOF, so a restarted master keeps its data). They never touch a shared server on 6379: each
gets its own port, folder and config, and `stop()` ends it (SIGTERM, then SIGKILL). `KVRagServer`
runs `kvrag serve` as its own process on a free port (waiting for `/health`), for HTTP clients.

    >>> server = RedisServer(tmp_path / "redis").start()       # doctest: +SKIP
    >>> engine = KVEngine(load_model("tiny-random-llama"), server.url)
    >>> server.stop()
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import redis

from kvrag.models import LoadedModel, load_model
from kvrag.models.loading import DEFAULT_ATTN

__all__ = ["RedisServer", "RedisCluster", "KVRagServer", "Request", "LoadReport", "answers_under_load", "free_port", "tiny_model"]


@lru_cache(maxsize=None)
def tiny_model(family: str = "llama", dtype: str = "float32", attn: str = DEFAULT_ATTN) -> LoadedModel:
    """`tiny-random-<family>`, loaded once per process: random weights, for tests that need breadth
    (every family, dtype and kernel) rather than a trained model's answers."""
    return load_model(f"tiny-random-{family}", dtype=dtype, attn=attn)

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out as connections' source ports (Linux; its default elsewhere)."""
    try:
        low, high = (int(p) for p in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too, as Redis Cluster needs, both
    outside the kernel's ephemeral range: a client connecting to a port nothing listens on yet can
    otherwise be given that very port as its source and connect to itself."""
    low, high = _ephemeral_range()
    candidates = [p for p in range(10000, 55536) if not (low <= p <= high or low <= p + 10000 <= high)]
    if not candidates:
        raise RuntimeError(f"no port pair outside the ephemeral range {low}-{high} for redis-server")
    for _ in range(1000):
        port = random.choice(candidates)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for redis-server")


@dataclass
class RedisServer:
    folder: Path
    port: int = field(default_factory=free_port)
    extra: tuple[str, ...] = ()
    process: subprocess.Popen | None = None
    #: with a password the server requires AUTH (`--requirepass`), and `url` carries it
    password: str | None = None

    @property
    def url(self) -> str:
        return f"redis://{':' + self.password + '@' if self.password else ''}127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        if not REDIS_SERVER:
            raise RuntimeError("redis-server is not installed; on Debian: apt-get install redis-server")
        self.folder.mkdir(parents=True, exist_ok=True)
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.folder), "--logfile", str(self.folder / "redis.log"), *self.extra,
                *(["--requirepass", self.password] if self.password else [])]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, password=self.password)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except redis.exceptions.ConnectionError as e:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    log = (self.folder / "redis.log").read_text()[-500:]
                    raise RuntimeError(f"redis-server on {self.port} did not start: {log}") from e
                time.sleep(0.05)
        client.close()
        return self

    def stop(self, *, kill: bool = False) -> None:
        if self.process and self.process.poll() is None:
            (self.process.kill if kill else self.process.terminate)()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None


@dataclass
class RedisCluster:
    """A cluster of `count` masters; its ports (and `url`) are chosen when it is made, so a client
    can be pointed at it before it starts."""

    folder: Path
    count: int = 3
    masters: list[RedisServer] = field(default_factory=list)

    def __post_init__(self) -> None:
        extra = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
                 "--appendonly", "yes")
        self.masters = self.masters or [RedisServer(self.folder / f"node{i}", extra=extra) for i in range(self.count)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{m.port}" for m in self.masters)

    def start(self) -> "RedisCluster":
        for server in self.masters:
            server.start()
        subprocess.run([REDIS_CLI, "--cluster", "create", *[f"127.0.0.1:{m.port}" for m in self.masters],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.wait_ok()
        return self

    def wait_ok(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for m in self.masters:
                try:
                    info = redis.Redis(port=m.port, socket_connect_timeout=0.2).cluster("info")
                    states.append(info.get("cluster_state") if isinstance(info, dict) else "ok" in str(info))
                except redis.exceptions.RedisError:
                    states.append(None)
            if all(s in ("ok", True) for s in states):
                return
            time.sleep(0.1)
        raise RuntimeError("the Redis cluster did not reach cluster_state:ok")

    def restart(self, index: int) -> None:
        """Kill one master and start it again from its own folder (its AOF and nodes.conf)."""
        server = self.masters[index]
        server.stop(kill=True)
        server.start()
        self.wait_ok()

    def stop(self) -> None:
        for m in self.masters:
            m.stop(kill=True)


@dataclass
class KVRagServer:
    """`kvrag serve` in its own process group on a free port; `url` is the OpenAI base URL."""

    model: str = "tiny-random-llama"
    store: str | None = None
    args: tuple[str, ...] = ()
    log: Path | None = None
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    #: a key the server was started with (in `args`), sent with the health checks
    api_key: str | None = None
    process: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.base + "/v1"

    def start(self, timeout: float = 120) -> "KVRagServer":
        command = [sys.executable, "-m", "kvrag.cli", "serve", "--model", self.model, "--port", str(self.port),
                   "--log-level", "warning", *(["--store", self.store] if self.store else []), *self.args]
        output = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                                        env={**os.environ, "HF_HUB_OFFLINE": "1", **self.env})
        deadline = time.monotonic() + timeout
        ready: set[int] = set()
        # workers share the port and load their models one by one: wait until each has said it is ready
        while len(ready) < self.workers:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop(kill=True)
                tail = self.log.read_text()[-2000:] if self.log and self.log.exists() else ""
                raise RuntimeError(f"kvrag serve on {self.port} did not become healthy: {tail}")
            worker = self.healthy_worker()
            if worker is None:
                time.sleep(0.2)
            else:
                ready.add(worker)
        return self

    @property
    def workers(self) -> int:
        """How many worker processes `args` asks for."""
        args = list(self.args)
        return int(args[args.index("--workers") + 1]) if "--workers" in args[:-1] else 1

    def healthy(self) -> bool:
        return self.healthy_worker() is not None

    def healthy_worker(self) -> int | None:
        """The process id of the worker that answered `/health` with 200, if one did."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.base + "/health", headers=headers),
                                        timeout=2) as response:
                return int(json.loads(response.read()).get("worker", 0)) if response.status == 200 else None
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError):  # not yet
            return None

    def stop(self, *, kill: bool = False, timeout: float = 60) -> int | None:
        """SIGTERM (graceful: requests in flight finish) or SIGKILL; the exit status."""
        if not self.process:
            return None
        process, self.process = self.process, None
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            return process.wait(10)


@dataclass(frozen=True)
class Request:
    """One chat request to a `KVRagServer`: a tenant's key (None: no key), a question after its
    documents, and (`leave_after`) the deltas its client reads before it goes away."""

    question: str
    documents: tuple[str, ...]
    key: str | None = None
    max_tokens: int = 8
    leave_after: int | None = None


@dataclass
class LoadReport:
    """What `answers_under_load` saw: answers, clients that went away, failures, and the answers
    unlike the same request served alone afterwards (first-token logits or text)."""

    answered: int = 0
    left: int = 0
    failed: list[str] = field(default_factory=list)
    unlike: list[str] = field(default_factory=list)
    modes: dict[str, int] = field(default_factory=dict)


def _ask(http: Any, server: KVRagServer, request: Request, model: str, *, stream: bool) -> tuple[str, str, str] | None:
    """One request: (first-token logits SHA-256, text, mode), or None when streamed (its client
    goes away after `leave_after` lines)."""
    body = {"model": model, "max_tokens": request.max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": request.question}],
            "kvrag": {"documents": list(request.documents), "memo": False}}
    headers = {"Authorization": f"Bearer {request.key}"} if request.key else {}
    if stream:
        with http.stream("POST", server.url + "/chat/completions", json=body, headers=headers) as response:
            for seen, _ in enumerate(response.iter_lines(), 1):
                if seen >= (request.leave_after or 1):
                    break
        return None
    response = http.post(server.url + "/chat/completions", json=body, headers=headers)
    response.raise_for_status()
    data = response.json()
    receipt = data["kvrag_receipt"]
    return receipt["first_token_logits_sha256"], data["choices"][0]["message"]["content"], receipt["mode"]


def answers_under_load(server: KVRagServer, requests: list[Request], clients: int, *, model: str,
                       timeout: float = 300) -> LoadReport:
    """Send `requests` from `clients` threads at once (those with `leave_after` streamed and left),
    then each answered one again, alone; every answer under load must equal its solo answer, bit
    for bit in its first-token logits and in its text."""
    import queue
    import threading

    import httpx

    report, answers = LoadReport(), {}
    todo: "queue.Queue[int]" = queue.Queue()
    for index in range(len(requests)):
        todo.put(index)
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(timeout=timeout) as http:
            while True:
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    return
                request = requests[index]
                try:
                    answer = _ask(http, server, request, model, stream=request.leave_after is not None)
                except (httpx.HTTPError, KeyError, ValueError) as e:
                    with lock:
                        report.failed.append(f"request {index}: {type(e).__name__}: {e}")
                    continue
                with lock:
                    if answer is None:
                        report.left += 1
                    else:
                        answers[index] = answer
                        report.answered += 1
                        report.modes[answer[2]] = report.modes.get(answer[2], 0) + 1

    threads = [threading.Thread(target=client, name=f"kvrag-load-client-{i}") for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with httpx.Client(timeout=timeout) as http:
        for index, (sha, text, mode) in sorted(answers.items()):
            solo = _ask(http, server, requests[index], model, stream=False)
            if solo is None or solo[:2] != (sha, text):
                report.unlike.append(f"request {index} ({mode} under load, {solo[2] if solo else '-'} alone)")
    return report
