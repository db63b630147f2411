"""One fleet, one key: a LangChain adapter and `kvrag serve` on one Redis, started with the same key
file (`signing_key_file=`, `--signing-key-file`), graft each other's states; the adapter with its own
generated key grafts none of them."""

from __future__ import annotations

import time
import uuid

import openai
from langchain_core.messages import HumanMessage
from langchain_kvrag import ChatKVRAG

from kvrag.testing import KVRagServer
from kvrag.trust import signing

MODEL = "tiny-random-llama"
DOCUMENT = "The lighthouse at Varrow Point was built in 1871 by the engineer Mara Quill, who also designed its lamp."
READ_AS_TEXT = {"text-prefill", "partial-graft"}


def _prompt() -> str:
    return f"{DOCUMENT} (Case {uuid.uuid4().hex[:8]}.)\n\nWho built the lighthouse?"


def _served(server: KVRagServer, prompt: str) -> dict:
    answer = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4)
    return answer.model_extra["kvrag_receipt"]


def _adapted(llm: ChatKVRAG, prompt: str) -> dict:
    return llm.invoke([HumanMessage(content=prompt)]).response_metadata["kvrag_receipt"]


def test_an_adapter_and_a_server_with_one_key_file_graft_each_others_states(redis_server, tmp_path, monkeypatch):
    for name in (signing.KEY_ENV, signing.KEY_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "adapter-home"))  # its own generated key differs from the fleet's
    fleet = tmp_path / "fleet.key"
    fleet.write_text("one-secret-for-the-whole-fleet-0123456789\n")
    server = KVRagServer(MODEL, redis_server.url, ("--signing-key-file", str(fleet)), log=tmp_path / "serve.log",
                         env={"KVRAG_HOME": str(tmp_path / "server-home")}).start()
    try:
        adapter = ChatKVRAG(model=MODEL, store=redis_server.url, signing_key_file=str(fleet), max_tokens=4,
                            deposit_in_background=False)
        # the adapter reads and deposits; the server grafts what it deposited
        prompt = _prompt()
        first = _adapted(adapter, prompt)
        assert first["mode"] in READ_AS_TEXT
        served = _served(server, prompt)
        assert served["mode"] == "exact-graft", served
        assert served["first_token_logits_sha256"] == first["first_token_logits_sha256"]

        # the server reads and deposits (after its answer, in the background); the adapter grafts it
        prompt = _prompt()
        assert _served(server, prompt)["mode"] in READ_AS_TEXT
        reader = ChatKVRAG(model=MODEL, store=redis_server.url, signing_key_file=str(fleet), max_tokens=4,
                           deposit_missing=False)  # reads only: nothing it answers is stored
        deadline = time.monotonic() + 60
        while (mode := _adapted(reader, prompt)["mode"]) != "exact-graft" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert mode == "exact-graft"

        # an adapter with its own generated key neither sees nor grafts the fleet's states
        alone = ChatKVRAG(model=MODEL, store=redis_server.url, max_tokens=4, deposit_missing=False)
        assert _adapted(alone, prompt)["mode"] in READ_AS_TEXT
    finally:
        server.stop(kill=True)
