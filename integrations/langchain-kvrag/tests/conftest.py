"""Fixtures for this distribution's tests: the models, the repository's examples, a throwaway Redis."""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from kvrag import LoadedModel, load_model  # noqa: E402
from kvrag.testing import tiny_model as tiny  # noqa: E402, F401 - the tests import it from here

QUESTION = "Who built the lighthouse?"


def load_example(name: str):
    """Import the repository's `examples/<name>.py` as a module (examples are scripts)."""
    path = pathlib.Path(__file__).resolve().parents[3] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture
def redis_server(tmp_path):
    from kvrag.testing import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()
