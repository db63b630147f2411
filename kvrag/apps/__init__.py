"""Applications built on an engine: `kvrag verify`, the A/B harness, the solution library, the
demo, store housekeeping (ls, inspect, gc), and what the framework adapters share."""

from kvrag.apps.frameworks import (
    FINGERPRINT_KEY,
    RECEIPT_KEY,
    STATE_KEY,
    STATE_METADATA_KEYS,
    EngineOpener,
    Retrieved,
    StateRetrieval,
    call_options,
    states_for,
)
from kvrag.apps.library import Library
from kvrag.apps.verify import VerifyReport, verify_model

__all__ = ["STATE_KEY", "FINGERPRINT_KEY", "RECEIPT_KEY", "STATE_METADATA_KEYS", "Retrieved", "StateRetrieval",
           "states_for", "EngineOpener", "call_options", "Library", "VerifyReport", "verify_model"]
