"""Fixtures for this distribution's tests: the tiny models."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from kvrag.testing import tiny_model as tiny  # noqa: E402, F401 - the tests import it from here

QUESTION = "Who built the lighthouse?"
