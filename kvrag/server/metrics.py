"""What `kvrag serve` counts, in Prometheus' format (`GET /metrics`).

With several workers (`kvrag serve --workers N`), every worker writes its samples into the folder
named by `PROMETHEUS_MULTIPROC_DIR` (the command sets one up) and `/metrics`, whichever worker
answers it, adds them all up.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from kvrag.core.receipt import Receipt

__all__ = ["CONTENT_TYPE_LATEST", "REQUESTS", "TENANT_REQUESTS", "REJECTED", "IN_FLIGHT", "QUEUED", "BATCH_ROWS", "observe",
           "exposition"]

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

REQUESTS = Counter("kvrag_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"])
#: with API keys: each tenant's requests by status (the tenant's name; "-" for the server's own)
TENANT_REQUESTS = Counter("kvrag_tenant_requests", "HTTP requests to /v1 by tenant and status code", ["tenant", "status"])
REJECTED = Counter("kvrag_rejected", "Requests turned away before they ran (queue full)", ["reason"])
IN_FLIGHT = Gauge("kvrag_in_flight", "Generations running now", multiprocess_mode="livesum")
QUEUED = Gauge("kvrag_queued", "Requests waiting for a generation slot", multiprocess_mode="livesum")
TTFT = Histogram("kvrag_ttft_seconds", "From the request's arrival to its first token (queueing included), by receipt mode",
                 ["mode"], buckets=_TTFT_BUCKETS)
RECEIPTS = Counter("kvrag_receipts", "Answers by receipt mode", ["mode"])
SEGMENTS = Counter("kvrag_segments", "Context segments by the tier whose state was grafted, or text and why",
                   ["tier", "outcome"])
MEMO_HITS = Counter("kvrag_memo_hits", "Recurring questions answered from their verified memo state")
BATCH_ROWS = Histogram("kvrag_batch_rows", "Generations whose decoding step one forward carried",
                       buckets=(1, 2, 4, 8, 16, 32, 64))
TOKENS = Counter("kvrag_tokens", "Tokens by what happened to them: reused (grafted), prefilled, decoded", ["kind"])


def observe(receipt: Receipt, ttft_s: float) -> None:
    """Count one answer by its receipt."""
    TTFT.labels(receipt.mode).observe(ttft_s)
    RECEIPTS.labels(receipt.mode).inc()
    if receipt.mode == "memo":
        MEMO_HITS.inc()
    for use in receipt.states:
        outcome = "graft" if use.source == "graft" else (use.reason or use.source)
        SEGMENTS.labels(_scheme(use.tier), outcome).inc()
    TOKENS.labels("reused").inc(receipt.tokens_reused)
    TOKENS.labels("prefilled").inc(receipt.tokens_prefilled)
    TOKENS.labels("decoded").inc(receipt.decode_tokens)


def _scheme(tier: str | None) -> str:
    """A tier's kind, never its URL (which may hold a password)."""
    return tier.partition("://")[0] if tier else "none"


def exposition() -> bytes:
    """All workers' samples when several share `PROMETHEUS_MULTIPROC_DIR`, else this process's."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest()
