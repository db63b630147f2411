"""The connector's benchmark page states the raw results it names: each TTFT table row is the row
`benchmarks/vllm_connector.py --print` makes of that raw file, and every raw file it names exists."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks" / "vllm-connector.md"
RESULTS = ROOT / "benchmarks" / "results"


def _script():
    spec = importlib.util.spec_from_file_location("vllm_connector_bench", ROOT / "benchmarks" / "vllm_connector.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_ttft_table_row_is_the_scripts_row_of_its_raw_file():
    page, script = PAGE.read_text(), _script()
    for name in ("vllm_connector_ttft_fp32.json", "vllm_connector_ttft_bf16.json"):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            script.print_ttft(json.loads((RESULTS / name).read_text()))
        rows = [line for line in printed.getvalue().splitlines() if re.match(r"\| [\d,]+ \|", line)]
        assert rows and all(row in page for row in rows), name


def test_the_load_table_is_the_scripts_table_of_its_raw_file():
    spec = importlib.util.spec_from_file_location("paged_load_bench", ROOT / "benchmarks" / "paged_load.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        script.print_table(json.loads((RESULTS / "paged_load.json").read_text()))
    rows = [line for line in printed.getvalue().splitlines() if line.startswith("| ")]
    assert len(rows) == 7 and all(row in PAGE.read_text() for row in rows)


def test_every_raw_file_the_page_names_exists():
    for name in re.findall(r"`(?:benchmarks/results/)?((?:vllm_connector|paged_load)[\w]*\.json)`", PAGE.read_text()):
        assert (RESULTS / name).is_file(), name
