"""Two processes depositing one key end with one valid state; a reader never sees a mix."""

from __future__ import annotations

import multiprocessing as mp
import threading

from kvrag import KVEngine, MemoryStore, open_store
from kvrag.artifacts.format import decode_payload, parse_manifest

from ..conftest import DOC_A, DOC_B, QUESTION, tiny


def _deposit(url: str, text: str, barrier, results) -> None:
    from kvrag import KVEngine, load_model

    engine = KVEngine(load_model("tiny-random-llama"), url)
    barrier.wait()
    results.put(engine.deposit(text).key)


def test_two_processes_depositing_the_same_key(redis_server, tmp_path):
    ctx = mp.get_context("spawn")
    for url in (f"{redis_server.url}?frame_mib=0.01", f"disk://{tmp_path}"):
        barrier, results = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_deposit, args=(url, DOC_A, barrier, results)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        keys = {results.get(timeout=5), results.get(timeout=5)}
        assert len(keys) == 1
        engine = KVEngine(tiny("llama"), url)
        key = keys.pop()
        assert list(engine.store.keys()) == [key]
        generation = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=3)
        assert generation.receipt.mode == "exact-graft"
        if url.startswith("redis"):
            assert engine.store.orphan_frames() == []  # same payload, same frame names


def test_a_reader_during_rewrites_sees_one_state_or_a_miss(redis_server):
    # Two different valid (manifest, payload) pairs written under one key, over and over.
    source = KVEngine(tiny("llama"), MemoryStore())
    a, b = source.deposit(DOC_A), source.deposit(DOC_B)
    pairs = [(source.store.read_manifest(r.key), source.store.read(r.key).payload) for r in (a, b)]
    key = "c" * 64
    writer_store = open_store(f"{redis_server.url}?frame_mib=0.005")
    reader_store = open_store(f"{redis_server.url}?frame_mib=0.005")
    stop, written = threading.Event(), threading.Event()
    writes = 0

    def write() -> None:
        nonlocal writes
        while not stop.is_set():
            writer_store.put(key, *pairs[writes % 2])
            writes += 1
            written.set()

    thread = threading.Thread(target=write)
    thread.start()
    seen = 0
    try:
        # Reads start once the key holds a state: before that every read is a miss, and on a loaded
        # machine the writer's first put can outlast all of them.
        assert written.wait(60)
        first = writes
        reads = 0
        # 200 reads, and on until at least two rewrites happened meanwhile
        while thread.is_alive() and (reads < 200 or writes < first + 2):
            reads += 1
            stored = reader_store.read(key)
            if stored is None:
                continue
            manifest = parse_manifest(stored.manifest)
            decode_payload(stored.payload, manifest)  # raises if manifest and payload came from different writes
            seen += 1
    finally:
        stop.set()
        thread.join()
    assert writes >= first + 2  # the writer did not stop on an error
    assert seen > 0
