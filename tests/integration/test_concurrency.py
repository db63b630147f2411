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
    stop = threading.Event()

    def write() -> None:
        i = 0
        while not stop.is_set():
            writer_store.put(key, *pairs[i % 2])
            i += 1

    thread = threading.Thread(target=write)
    thread.start()
    seen = 0
    try:
        for _ in range(200):
            stored = reader_store.read(key)
            if stored is None:
                continue
            manifest = parse_manifest(stored.manifest)
            decode_payload(stored.payload, manifest)  # raises if manifest and payload came from different writes
            seen += 1
    finally:
        stop.set()
        thread.join()
    assert seen > 0
