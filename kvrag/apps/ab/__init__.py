"""`kvrag ab`: text RAG and KV RAG side by side on your own data: the harness (`run`), its
rows and summary (`results`), the report with plots (`report`), skewed question streams (`streams`)
and levers measured over several independent streams (`sweep`)."""

from kvrag.apps.ab.report import summary_rows, write_report
from kvrag.apps.ab.results import ABRow, ABSummary, Order, Policy, contains_gold, load_jsonl
from kvrag.apps.ab.run import run_ab
from kvrag.apps.ab.streams import Phrasings, Stream, skewed_stream
from kvrag.apps.ab.sweep import (
    BASELINE,
    Interval,
    LeverOnStream,
    LeverSweep,
    LeverVerdict,
    PositionSensitivity,
    Spread,
    StreamSpec,
    bootstrap_mean,
    independent_streams,
    position_sensitivity,
    sweep_levers,
)

__all__ = ["ABRow", "ABSummary", "Policy", "Order", "load_jsonl", "contains_gold", "run_ab", "write_report",
           "summary_rows", "Stream", "Phrasings", "skewed_stream", "BASELINE", "Interval", "LeverOnStream",
           "LeverSweep", "LeverVerdict", "PositionSensitivity", "Spread", "StreamSpec", "bootstrap_mean",
           "independent_streams", "position_sensitivity", "sweep_levers"]
