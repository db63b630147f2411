"""Redis Cluster: a 3-master cluster started for this module, real states through it."""

from __future__ import annotations

import logging
import time

import pytest

from kvrag import KVEngine, MemoryStore
from kvrag.data import long_document
from kvrag.testing import KVRagServer, RedisCluster

from ..conftest import DOC_A, QUESTION, tiny


def _node_index(cluster, store, key):
    node = store.client.get_node_from_key(f"kvrag:{{{key}}}:m")
    return [m.port for m in cluster.masters].index(node.port)


def test_deposit_and_restore_through_the_cluster_survive_a_master_restart(redis_cluster):
    engine = KVEngine(tiny("qwen2"), f"{redis_cluster.url}?frame_mib=0.01")
    reference = KVEngine(tiny("qwen2"), MemoryStore()).generate(QUESTION, states=[DOC_A], max_new_tokens=4, graft=False)
    refs = [engine.deposit(f"{DOC_A} Copy {i}.") for i in range(6)]
    nodes = {_node_index(redis_cluster, engine.store, r.key) for r in refs}
    assert len(nodes) > 1  # hash tags spread states over masters; each state's frames share one slot
    ref = engine.deposit(DOC_A)
    graft = engine.generate(QUESTION, states=[ref], max_new_tokens=4)
    assert graft.receipt.mode == "exact-graft" and graft.receipt.states[0].tier.startswith("redis+cluster://")
    assert graft.receipt.first_token_logits_sha256 == reference.receipt.first_token_logits_sha256

    redis_cluster.restart(_node_index(redis_cluster, engine.store, ref.key))
    after = KVEngine(tiny("qwen2"), f"{redis_cluster.url}?frame_mib=0.01").generate(QUESTION, states=[ref], max_new_tokens=4)
    assert after.receipt.mode == "exact-graft"
    assert after.receipt.first_token_logits_sha256 == reference.receipt.first_token_logits_sha256


def test_a_run_of_paged_blocks_spread_over_the_masters_lands_bit_for_bit(redis_cluster):
    import torch

    from kvrag.paged import BlockEngine, BlockLayer, BlockStore
    from kvrag.stores import open_store

    store = open_store(f"{redis_cluster.url}?frame_mib=0.01")
    blocks = BlockStore(store, BlockEngine({"layout": "BHTC"}), b"k" * 32)
    chain = blocks.chain(list(range(96)), 16)
    cache = [torch.randn(12, 2, 16, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for index, block in enumerate(chain):
        blocks.save(block, [layer[index] for layer in cache])
    assert len({_node_index(redis_cluster, store, b.key) for b in chain}) > 1
    assert blocks.held(chain) == 6
    layers = [BlockLayer.of(str(i), layer[0]) for i, layer in enumerate(cache)]
    run = blocks.load_run(chain, [[layer[6 + i] for layer in cache] for i in range(6)], layers)
    assert run.error is None and run.landed == 6 and sum(run.tiers.values()) == 6
    assert all(torch.equal(layer[6 + i], layer[i]) for layer in cache for i in range(6))


@pytest.mark.slow
def test_a_state_larger_than_100_mb_through_the_cluster(redis_cluster, smollm2):
    engine = KVEngine(smollm2, redis_cluster.url)
    document = long_document(smollm2.tokenizer, 2400)
    ref = engine.deposit(document)
    frame_table = engine.store.get_frame_table(ref.key)
    assert frame_table.payload_bytes > 100 * 2**20 and len(frame_table.frames) > 12
    graft = engine.generate("Who built the lighthouse?", states=[ref], max_new_tokens=3)
    text = engine.generate("Who built the lighthouse?", states=[ref], max_new_tokens=3, graft=False)
    assert graft.receipt.mode == "exact-graft"
    assert graft.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256


def _until_grafted(ask, seconds: float = 30.0):
    """`ask()` again until its answer grafts (or `seconds` pass): a cluster forming takes a moment."""
    deadline = time.monotonic() + seconds
    while True:
        answer = ask()
        if _mode(answer) == "exact-graft" or time.monotonic() > deadline:
            return answer
        time.sleep(0.2)


def _mode(answer) -> str:
    return answer.receipt.mode if hasattr(answer, "receipt") else answer.model_extra["kvrag_receipt"]["mode"]


def test_a_cluster_down_at_start_answers_by_text_then_grafts_once_it_is_up(tmp_path, caplog):
    cluster = RedisCluster(tmp_path / "later")
    engine = KVEngine(tiny("qwen2"), cluster.url)  # nothing listens yet: it starts all the same
    reference = KVEngine(tiny("qwen2"), MemoryStore()).generate(QUESTION, states=[DOC_A], max_new_tokens=4, graft=False)
    with caplog.at_level(logging.WARNING, logger="kvrag"):
        for _ in range(3):
            down = engine.generate(QUESTION, states=[DOC_A], max_new_tokens=4, deposit_missing=True)
            assert down.receipt.mode == "text-prefill" and down.receipt.states[0].reason == "unavailable"
            assert down.receipt.first_token_logits_sha256 == reference.receipt.first_token_logits_sha256
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "is unavailable" in warned[0], warned
    cluster.start()
    try:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvrag"):
            answer = _until_grafted(lambda: engine.generate(QUESTION, states=[DOC_A], max_new_tokens=4,
                                                            deposit_missing=True))
        assert answer.receipt.mode == "exact-graft" and answer.receipt.states[0].tier.startswith("redis+cluster://")
        assert answer.receipt.first_token_logits_sha256 == reference.receipt.first_token_logits_sha256
        assert "answers again" in caplog.text
    finally:
        cluster.stop()


def test_serve_started_with_the_cluster_down_answers_by_text_then_grafts(tmp_path):
    import openai

    cluster = RedisCluster(tmp_path / "later")
    log = tmp_path / "serve.log"
    # no hot tier in the worker: every graft is read from the cluster
    server = KVRagServer("tiny-random-qwen2", cluster.url, ("--hot-mib", "0"), log=log).start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)

        def ask():
            return client.chat.completions.create(
                model="tiny-random-qwen2", messages=[{"role": "user", "content": QUESTION}], max_tokens=4,
                extra_body={"kvrag": {"documents": [DOC_A], "memo": False}})

        down = [ask() for _ in range(3)]
        assert {_mode(a) for a in down} == {"text-prefill"}
        assert log.read_text().count("is unavailable") == 1
        cluster.start()
        answer = _until_grafted(ask)
        assert _mode(answer) == "exact-graft"
        assert answer.model_extra["kvrag_receipt"]["states"][0]["tier"].startswith("redis+cluster://")
        assert answer.choices[0].message.content == down[0].choices[0].message.content
        assert answer.model_extra["kvrag_receipt"]["first_token_logits_sha256"] == \
            down[0].model_extra["kvrag_receipt"]["first_token_logits_sha256"]
    finally:
        server.stop(kill=True)
        cluster.stop()
