"""Every Python name the README and the docs mention exists, and every public name is documented.

A name is a backticked `kvrag.dotted.path`, or a backticked class name (`Receipt`,
`KVEngine.deposit`, `Memo.recall(...)`): a kvrag class must have the attributes the text names; a
class kvrag does not define must be one of the other libraries' names the docs quote."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from functools import cache
from pathlib import Path

import kvrag

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CODE_SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^kvrag(?:\.[A-Za-z_]\w*)+$")
CLASS_CHAIN = re.compile(r"^([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)((?:\.[A-Za-z_]\w*)*)(?:\(.*\))?$")
#: other libraries' classes the docs name, with where they live
OTHER_LIBRARIES = {
    "AsyncCacheTestSuite": "langchain_tests", "BaseLLM": "langchain_core", "ChatModelIntegrationTests": "langchain_tests",
    "ChatModelUnitTests": "langchain_tests", "ChatOpenAI": "langchain_openai", "CondensePlusContextChatEngine": "llama_index",
    "DynamicCache": "transformers", "DynamicLayer": "transformers", "DynamicSlidingWindowLayer": "transformers",
    "InMemoryVectorStore": "langchain_core", "OpenAILike": "llama_index", "PromptTemplate": "langchain_core",
    "RetrieverQueryEngine": "llama_index", "RetrieversIntegrationTests": "langchain_tests", "Settings": "llama_index",
    "SyncCacheTestSuite": "langchain_tests", "AutoModelForCausalLM": "transformers", "AuthenticationError": "openai",
    "BM25Retriever": "langchain_community", "AIMessage": "langchain_core", "LLMChatEndEvent": "llama_index",
    "Conv1D": "transformers",
    # the vLLM connector's distribution, importable only in vLLM's environment (`make vllm-env`)
    "KVRagConnector": "vllm_kvrag", "ConnectorSettings": "vllm_kvrag",
}
#: dotted kvrag words that are not Python: the server's request fields and the stored format's name
NOT_PYTHON = {"kvrag.documents", "kvrag.admit_after", "kvrag.state"}


#: kvrag and its integrations' packages, whose names the docs may mention bare
PACKAGES = ("kvrag", "langchain_kvrag", "llama_index.llms.kvrag", "llama_index.retrievers.kvrag")


@cache
def kvrag_classes() -> dict[str, list[object]]:
    """Every class (and nested class) defined in a module of kvrag or its integrations, and every
    name a module exports (type aliases included), by name: several modules may each define one."""
    found: dict[str, list[object]] = {}
    for package in map(importlib.import_module, PACKAGES):
        modules = [package.__name__] + [info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
        for name in modules:
            if name.startswith(("kvrag.cli", "kvrag.__main__")):
                continue
            module = importlib.import_module(name)
            for attribute, value in vars(module).items():
                defined_here = inspect.isclass(value) and value.__module__ == name
                if defined_here or attribute in getattr(module, "__all__", ()):
                    found.setdefault(attribute, []).append(value)
                if defined_here:
                    found.update({f"{attribute}.{inner}": [v] for inner, v in vars(value).items() if inspect.isclass(v)})
    return found


def has_attribute(owner: object, name: str) -> bool:
    """An attribute, a method, a dataclass or pydantic field, an enum member, or an annotated field."""
    if not inspect.isclass(owner):
        return hasattr(owner, name)
    fields = getattr(owner, "model_fields", {}) or getattr(owner, "__dataclass_fields__", {})
    annotated = {n for klass in owner.__mro__ for n in getattr(klass, "__annotations__", {})}
    return hasattr(owner, name) or name in fields or name in annotated


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            if not hasattr(value, part):
                return False
            value = getattr(value, part)
        return True
    return False


def unknown_names(text: str) -> list[str]:
    """Names of `text` that do not exist."""
    unknown = []
    for span in CODE_SPAN.findall(text):
        if DOTTED.match(span) and span not in NOT_PYTHON and not resolves(span):
            unknown.append(f"{span}: no such module or attribute")
        chain = CLASS_CHAIN.match(span)
        if chain is None:
            continue
        owner, attributes = chain[1], [a for a in chain[2].split(".") if a]
        classes = kvrag_classes().get(owner)
        if classes is None:
            if owner not in OTHER_LIBRARIES:
                unknown.append(f"{span}: kvrag has no class {owner} and it is no other library's the docs quote")
            continue
        if attributes and not any(has_attribute(klass, attributes[0]) for klass in classes):
            unknown.append(f"{span}: {owner} has no attribute {attributes[0]}")
    return unknown


def test_every_python_name_the_docs_mention_exists():
    assert len(kvrag_classes()) > 100 and "KVEngine" in kvrag_classes()
    found = {page.relative_to(ROOT).as_posix(): unknown_names(page.read_text(encoding="utf-8")) for page in PAGES}
    assert {page: names for page, names in found.items() if names} == {}


def test_every_public_name_is_documented():
    text = "\n".join(page.read_text(encoding="utf-8") for page in PAGES)
    mentioned = {m for span in CODE_SPAN.findall(text) for m in re.findall(r"\w+", span)}
    rendered = set(re.findall(r"^::: kvrag\.(\w+)$", text, re.MULTILINE))
    rendered |= {name for module in rendered if inspect.ismodule(getattr(kvrag, module, None))
                 for name in getattr(kvrag, module).__all__}
    assert [name for name in kvrag.__all__ if name not in mentioned | rendered] == []


def test_a_planted_unknown_name_is_found():
    page = ("`KVEngine.deposit` makes a `Receipt`; `kvrag.core.RAG_DEFAULTS` holds the defaults.\n"
            "Stale: `Checked`, `KVEngine.deposits`, `kvrag.core.NO_SUCH_NAME`, `kvrag.nowhere`; "
            "theirs: `DynamicCache`.\n")
    assert unknown_names(page) == [
        "Checked: kvrag has no class Checked and it is no other library's the docs quote",
        "KVEngine.deposits: KVEngine has no attribute deposits",
        "kvrag.core.NO_SUCH_NAME: no such module or attribute",
        "kvrag.nowhere: no such module or attribute",
    ]
