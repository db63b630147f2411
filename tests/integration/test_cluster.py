"""Redis Cluster: a 3-master cluster started for this module, real states through it."""

from __future__ import annotations

import pytest

from kvrag import KVEngine, MemoryStore
from kvrag.data import long_document

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
