"""`kvrag ab`: text RAG and KV RAG side by side on your own data: the harness (`run`), its
rows and summary (`results`), the report with plots (`report`) and skewed question streams (`streams`)."""

from kvrag.apps.ab.report import summary_rows, write_report
from kvrag.apps.ab.results import ABRow, ABSummary, Order, Policy, load_jsonl
from kvrag.apps.ab.run import run_ab
from kvrag.apps.ab.streams import Stream, skewed_stream

__all__ = ["ABRow", "ABSummary", "Policy", "Order", "load_jsonl", "run_ab", "write_report", "summary_rows", "Stream", "skewed_stream"]
