"""What a client of `kvrag serve` can try, against a real server process: no key or a wrong one,
a field the server does not know (a typo, or one hidden inside a message), a field it cannot
honour. Each is refused by name, in OpenAI's error shape, and nothing is read or stored for it."""

from __future__ import annotations

import httpx
import pytest

from kvrag.testing import KVRagServer

from ..conftest import QUESTION

KEY = "attack-suite-key-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    served = KVRagServer("tiny-random-llama", "memory://", ("--api-key", KEY), log=folder / "serve.log",
                         api_key=KEY).start()
    yield served
    served.stop(kill=True)


def _post(server, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}".strip()} if key is not None else {}
    request = {"model": "tiny-random-llama", "max_tokens": 2, "messages": [{"role": "user", "content": QUESTION}], **body}
    return httpx.post(server.url + "/chat/completions", json=request, headers=headers, timeout=60)


@pytest.mark.parametrize("key", [None, "", "attack-suite-key-012345678", "ATTACK-SUITE-KEY-0123456789", "x" * 4096])
def test_without_the_key_every_request_is_401(server, key):
    response = _post(server, {}, key)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("body, named", [
    ({"max_token": 3}, "max_token"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": QUESTION, "cache_control": {"type": "ephemeral"}}]}, "cache_control"),
    ({"kvrag": {"documents": [], "grafting": False}}, "grafting"),
])
def test_a_field_the_server_does_not_know_or_honour_is_a_400_that_names_it(server, body, named):
    response = _post(server, body)
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]
    assert _post(server, {}).status_code == 200  # the same request without it answers
