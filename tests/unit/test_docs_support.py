"""The support page's lists are the code's: the embedded models, the tiny families, the dtypes and
kernels `load_model` accepts, and the kernel names a model fingerprint can carry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvrag.kernels import linear
from kvrag.models import fingerprints, loading
from kvrag.models.tiny import TINY_FAMILIES

PAGE = (Path(__file__).parents[2] / "docs" / "reference" / "support.md").read_text(encoding="utf-8")
REQUIREMENTS = (Path(__file__).parents[2] / "pyproject.toml").read_text(encoding="utf-8")


def section(title: str) -> str:
    return PAGE.split(f"## {title}\n")[1].split("\n## ")[0]


def first_column(table: str) -> list[str]:
    return [row.split("|")[1].strip() for row in table.splitlines() if row.startswith("| `")]


def test_the_models_table_names_every_embedded_model_and_family():
    models = section("Models")
    assert [m.strip("`") for m in first_column(models)[:2]] == list(loading.GGUF_MODELS)
    families = re.search(r"`tiny-random-<family>`: (.*?) \|", models)[1]
    assert re.findall(r"`(\w+)`", families) == sorted(TINY_FAMILIES)
    rows = [line for line in models.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 4
    for row in rows:
        assert re.findall(r"`(invariant|sdpa|eager)`", row.split("|")[3]) == ["invariant", "sdpa", "eager"]
    assert set(loading.ATTNS) == {"invariant", "sdpa", "eager"}


def test_the_dtype_table_names_every_dtype_and_its_kernel_name():
    kernels = section("Data types and kernels")
    assert [d.strip("`") for d in first_column(kernels)] == list(loading.DTYPES)
    named = set(re.findall(r"`(invariant/[\w/-]+)`", PAGE))
    assert named == {"invariant/3", "invariant/2", "invariant/3-onednn-f32", "invariant/3-onednn-capped",
                     "invariant/3-onednn-amx"}
    row = {d.strip("`"): line for line in kernels.splitlines() if line.startswith("| `") for d in [line.split("|")[1].strip()]}
    assert "invariant/2" in row["float16"] and "invariant/3" not in row["float16"]
    assert linear.linear_kernel(torch.float16) == "stock"


@pytest.mark.parametrize("kernel", ["onednn", "stock", "onednn-f32", "onednn-capped", "onednn-amx"])
def test_every_kernel_name_the_code_gives_is_on_the_page(kernel, monkeypatch):
    monkeypatch.setattr(fingerprints, "linear_kernel", lambda dtype: kernel)
    assert f"`{fingerprints.kernel_name('invariant', torch.float32)}`" in PAGE


def test_the_versions_the_page_states_are_the_requirements():
    assert '"transformers>=5.24,<6"' in REQUIREMENTS and '"torch>=2.4"' in REQUIREMENTS
    assert "transformers 5.24 or later (below 6)" in PAGE and "torch 2.4 or later" in PAGE
