"""The examples kvrag's own distribution ships run offline, as a user runs them (the framework
examples run in the integrations' own tests and in tests/integration/test_dropin.py)."""

from __future__ import annotations

import pytest

from ..conftest import load_example

pytestmark = pytest.mark.slow


def test_redis_tiers_grafts_from_each_tier(redis_server):
    rows = load_example("redis_tiers").main(redis_server.url)
    assert [r["mode"] for r in rows] == ["exact-graft"] * 3
    assert rows[0]["tier"] == redis_server.url and rows[1]["tier"].startswith("disk://")
    assert len({r["logits"] for r in rows}) == 1


def test_serve_with_the_openai_client_grafts_the_second_question():
    rows = load_example("serve_openai").main()
    assert [r["mode"] for r in rows] == ["text-prefill", "exact-graft"]
    assert rows[0]["cached"] == 0 < rows[1]["cached"] and rows[0]["answer"] == rows[1]["answer"]


def test_a_model_folder_of_ones_own_grafts_exactly():
    result = load_example("own_model_folder").main()
    assert result["mode"] == "exact-graft" and result["same_logits"]


def test_wrapping_existing_retrievers_grafts_from_the_first_question():
    assert load_example("wrap_retrievers").main() == {"langchain": "exact-graft", "llamaindex": "exact-graft"}
