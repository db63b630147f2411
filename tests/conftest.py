from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from kvrag import KVEngine, LoadedModel, MemoryStore, load_model  # noqa: E402
from kvrag.models import TINY_FAMILIES  # noqa: E402
from kvrag.models.loading import DEFAULT_ATTN  # noqa: E402
from kvrag.testing import tiny_model  # noqa: E402

FAMILIES = sorted(TINY_FAMILIES)
DTYPES = ["float32", "bfloat16"]
ATTNS = ["sdpa", "eager"]

DOC_A = (
    "The lighthouse at Varrow Point was built in 1871 by the engineer Mara Quill. The tower is 38 metres tall "
    "and made of grey granite quarried at Holm. Its first lamp burned whale oil and could be seen far out at sea."
)
DOC_B = "In 1904 the lamp was converted to kerosene, and in 1952 it was electrified. The last keeper retired in 1988."
DOC_C = "Today the tower is a museum. Visitors climb 212 steps to the lantern room, where the Fresnel lens remains."
QUESTION = "Who built the lighthouse?"
#: receipt modes of a request whose document is read as text: under the default kernel a stored
#: prompt header (template and system text another prompt began with) may be grafted before it
READ_AS_TEXT = ("text-prefill", "partial-graft")


def tiny(family: str, dtype: str = "float32", attn: str = DEFAULT_ATTN) -> LoadedModel:
    return tiny_model(family, dtype, attn)


def first_token_sha_at_threads(model: LoadedModel, documents: list[str], question: str,
                                counts: tuple[int, ...] = (1, 2)) -> list[str]:
    """The text path's first-token logits SHA-256 for the same prompt at each torch thread count
    (an engine built at each, as a process of that many threads would build it)."""
    import torch

    shas = []
    threads = torch.get_num_threads()
    try:
        for count in counts:
            torch.set_num_threads(count)
            engine = KVEngine(model, MemoryStore())
            shas.append(engine.generate(question, states=documents, max_new_tokens=1, graft=False)
                        .receipt.first_token_logits_sha256)
    finally:
        torch.set_num_threads(threads)
    return shas


def resigned(engine: KVEngine, manifest: bytes | dict) -> bytes:
    """Manifest bytes (or a manifest edited as a dict) signed with `engine`'s key: what someone
    holding the key could write, so a test reaches the checks behind the signature."""
    import json

    from kvrag.trust.signing import sign_manifest_bytes

    fields = dict(json.loads(manifest) if isinstance(manifest, bytes) else manifest, signature=None)
    return sign_manifest_bytes(json.dumps(fields).encode(), engine.signing_key)


def load_example(name: str):
    """Import `examples/<name>.py` as a module (examples are scripts, not a package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture
def llama_engine() -> KVEngine:
    return KVEngine(tiny("llama"), MemoryStore())


@pytest.fixture
def redis_server(tmp_path):
    from kvrag.testing import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    from kvrag.testing import RedisCluster

    cluster = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield cluster
    cluster.stop()
