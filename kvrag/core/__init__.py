"""The path every answer takes: prompt layout and transcripts, the schedule, restore and
acceptance, the prefill, the runner, decoding, the receipt, deposits, and the `Engine` protocol."""

from kvrag.core.continuation import Continuation
from kvrag.core.decoding import Generation, GenerationStream
from kvrag.core.deposit import CANARY_QUESTION
from kvrag.core.options import RAG_DEFAULTS, GenerationOptions, GenerationSettings, Order
from kvrag.core.protocol import Engine
from kvrag.core.receipt import REASONS, Receipt, StateUse, Timings
from kvrag.core.runner import logits_sha256
from kvrag.core.sampling import Sampling
from kvrag.core.schedule import Segment, StateRef
from kvrag.core.transcript import Message

__all__ = ["Continuation", "Generation", "GenerationStream", "CANARY_QUESTION", "Engine", "GenerationOptions", "GenerationSettings",
           "Order", "RAG_DEFAULTS",
           "Receipt", "StateUse", "Timings", "REASONS", "logits_sha256", "Sampling", "Segment", "StateRef", "Message"]
