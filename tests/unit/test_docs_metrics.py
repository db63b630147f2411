"""The metrics reference lists exactly the metrics `kvrag serve` exposes, with their labels."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from kvrag.server import metrics

PAGE = Path(__file__).parents[2] / "docs" / "reference" / "metrics.md"


def exposed() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Each metric's exposed name -> (type, label names)."""
    found = {}
    for value in vars(metrics).values():
        if isinstance(value, (Counter, Gauge, Histogram)):
            kind = type(value).__name__.lower()
            name = value._name + ("_total" if kind == "counter" else "")
            found[name] = (kind, tuple(value._labelnames))
    return found


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    rows = re.findall(r"^\| `(kvrag_\w+)` \| (\w+) \|([^|]*)\|", PAGE.read_text(), re.M)
    # a label is a name in backticks outside parentheses (which hold its values)
    return {name: (kind, tuple(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", labels)))) for name, kind, labels in rows}


def test_every_exposed_metric_is_documented_with_its_type_and_labels():
    assert len(exposed()) >= 10
    assert documented() == exposed()
