"""The blend gate: a model may blend only after its blends were measured against the exact path.

`BlendGate.calibrate` runs a calibration set of two-document prompts (the second document's state
deposited on its own, then moved and blended after the first) and the same prompts read exactly,
and measures the first token's KL divergence and argmax agreement. The result is a sealed record
bound to the model and hardware fingerprints and the blend setting. A model that was never
calibrated, or whose measured KL and agreement miss the engine's own limits (`BlendLimits`, applied
to the stored figures whatever thresholds the verdict names), does not blend: its answers stay
exact, and the receipt says why.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from typing import Iterator, Literal, Sequence

import torch
from pydantic import BaseModel, Field, ValidationError

from kvrag.core.continuation import Continuation, plan_segments
from kvrag.core.deposit import Depositor
from kvrag.core.protocol import BlendLimits
from kvrag.core.schedule import Planner
from kvrag.errors import InputError
from kvrag.reuse.blend import DEFAULT_RECOMPUTE_RATIO
from kvrag.stores.deadline import Deadline
from kvrag.trust.identity import EngineIdentity
from kvrag.trust.records import SealedRecords

__all__ = ["GateResult", "BlendGate", "MAX_MEAN_KL", "MIN_AGREEMENT", "kl_divergence"]

#: Default limits: mean first-token KL (nats) at most this, argmax agreement at least this.
MAX_MEAN_KL = BlendLimits().max_mean_kl
MIN_AGREEMENT = BlendLimits().min_agreement


class GateResult(BaseModel):
    format: Literal["kvrag.gate/1"] = "kvrag.gate/1"
    model: str
    model_fingerprint: str
    hardware_fingerprint: str
    ratio: float
    rerotate: bool
    samples: int
    kl_mean: float
    kl_max: float
    argmax_agreement: float
    max_mean_kl: float
    min_agreement: float
    passed: bool
    at: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat())

    def allows(self, limits: BlendLimits) -> bool:
        """Whether this verdict lets a blend through under `limits`: it passed, and its measured
        figures are within them, whatever thresholds it was made under."""
        return self.passed and self.kl_mean <= limits.max_mean_kl and self.argmax_agreement >= limits.min_agreement


def kl_divergence(exact: torch.Tensor, approximate: torch.Tensor) -> float:
    """KL(exact || approximate) of two logits vectors, in nats."""
    p, q = torch.log_softmax(exact.float(), -1), torch.log_softmax(approximate.float(), -1)
    return float((p.exp() * (p - q)).sum())


class BlendGate:
    """Whether an engine may blend: its verdicts are sealed records, measured by running blends
    and their exact paths on documents its depositor stores. Running them is the engine's
    (`kvrag.engine.gate`): here are the trials and the verdict."""

    def __init__(self, identity: EngineIdentity, planner: Planner, records: SealedRecords, depositor: Depositor,
                 *, limits: BlendLimits, deadline_s: float) -> None:
        self.identity, self.planner, self.records = identity, planner, records
        self.depositor, self.limits, self.deadline_s = depositor, limits, deadline_s

    def slot(self, ratio: float = DEFAULT_RECOMPUTE_RATIO, rerotate: bool = True) -> str:
        """The sealed record a verdict for this setting lives in."""
        setting = f"kvrag-blend-gate\x00{self.identity.scope}\x00{ratio:.3f}\x00{int(rerotate)}"
        return "gate/" + hashlib.sha256(setting.encode()).hexdigest()

    def tightened(self, max_mean_kl: float | None, min_agreement: float | None) -> tuple[float, float]:
        """A calibration's limits: the engine's, or tighter (never looser)."""
        limits = self.limits
        max_mean_kl = limits.max_mean_kl if max_mean_kl is None else max_mean_kl
        min_agreement = limits.min_agreement if min_agreement is None else min_agreement
        if max_mean_kl > limits.max_mean_kl or min_agreement < limits.min_agreement:
            raise InputError(
                f"a calibration cannot loosen this engine's blend limits (mean KL at most {limits.max_mean_kl:g}, "
                f"argmax agreement at least {limits.min_agreement:.0%}); set KVEngine(blend_limits=...) to change them"
            )
        return max_mean_kl, min_agreement

    def trials(self, documents: Sequence[str] | None, questions: Sequence[str] | None, *, ratio: float,
               rerotate: bool, samples: int) -> Iterator[tuple[Continuation, Continuation]]:
        """`samples` prompts built from `documents` (two documents, then a question about the second;
        default: the bundled sample set), each as its exact path (read as text) and as a blend of
        the documents' stored states (deposited here first)."""
        if not 0 < ratio <= 1 or samples < 1:
            raise InputError("the recompute ratio must be in (0, 1] and samples at least 1")
        if documents is None:
            from kvrag.data import sample_docs, sample_questions

            by_doc = {q.doc_id: q.question for q in sample_questions()}
            pairs = [(d.text, by_doc.get(d.id, "What is this text about?")) for d in sample_docs()]
        else:
            asked = list(questions or [])
            pairs = [(d, asked[i] if i < len(asked) else "What is this text about?") for i, d in enumerate(documents)]
        if len(pairs) < 2:
            raise InputError("calibrating a blend needs at least two documents")
        for i in range(samples):
            (first, _), (second, question) = pairs[i % len(pairs)], pairs[(i + 1 + i // len(pairs)) % len(pairs)]
            roots = [self.planner.documents([text])[0] for text in (first, second)]
            for root in roots:
                self.depositor.ensure(root)
            segments = self.planner.documents([first, second])
            feed = self.planner.question(question, segments)
            refs = [self.planner.ref(r) for r in roots]
            yield (Continuation(plan_segments(segments, graft=False), feed, 1),
                   Continuation(plan_segments(segments, refs, scope=self.identity.scope_id, blend=ratio, rerotate=rerotate), feed, 1))

    def verdict(self, kls: Sequence[float], agreed: int, *, ratio: float, rerotate: bool, max_mean_kl: float,
                min_agreement: float) -> GateResult:
        """The verdict of trials whose KL divergences were `kls` and whose argmax agreed `agreed`
        times, stored."""
        kl_mean, agreement = sum(kls) / len(kls), agreed / len(kls)
        result = GateResult(
            model=self.identity.model.name, model_fingerprint=self.identity.model_digest,
            hardware_fingerprint=self.identity.hardware.digest,
            ratio=ratio, rerotate=rerotate, samples=len(kls), kl_mean=kl_mean, kl_max=max(kls),
            argmax_agreement=agreement, max_mean_kl=max_mean_kl, min_agreement=min_agreement,
            passed=kl_mean <= max_mean_kl and agreement >= min_agreement,
        )
        self.records.put(self.slot(ratio, rerotate), result.model_dump_json().encode())
        return result

    def result(self, ratio: float = DEFAULT_RECOMPUTE_RATIO, rerotate: bool = True,
               deadline: Deadline | None = None) -> GateResult | None:
        """The stored verdict for this engine's model, hardware and setting (None if never
        calibrated, or not read within `deadline`)."""
        body = self.records.get(self.slot(ratio, rerotate), deadline or Deadline(self.deadline_s))
        if body is None:
            return None
        try:
            result = GateResult.model_validate_json(body)
        except ValidationError:
            return None
        bound = (result.model_fingerprint == self.identity.model_digest
                 and result.hardware_fingerprint == self.identity.hardware.digest
                 and abs(result.ratio - ratio) < 5e-4 and result.rerotate == rerotate)
        return result if bound else None

    def refusal(self, ratio: float = DEFAULT_RECOMPUTE_RATIO, rerotate: bool = True,
                deadline: Deadline | None = None) -> str | None:
        """Why this engine may not blend with this setting (None: it may)."""
        result = self.result(ratio, rerotate, deadline)
        if result is None:
            return (f"blending is not calibrated for {self.identity.model.name} at ratio {ratio:.2f}; "
                    "run `kvrag calibrate` (or engine.gate.calibrate()) first")
        limits = self.limits
        if not result.allows(limits):
            return (f"the blend gate refused {result.model} at ratio {result.ratio:.2f}: mean KL {result.kl_mean:.3g} "
                    f"(at most {min(result.max_mean_kl, limits.max_mean_kl):g}), argmax agreement "
                    f"{result.argmax_agreement:.0%} (at least {max(result.min_agreement, limits.min_agreement):.0%}) "
                    f"over {result.samples} prompts")
        return None
