"""The engine's blend gate: calibrating runs blends and their exact paths on the engine that
answers, so it lives here, above `kvrag.reuse.gate`, which holds the trials and the verdicts."""

from __future__ import annotations

from typing import Callable, Sequence

from kvrag.core.continuation import Continuation
from kvrag.core.decoding import GenerationStream
from kvrag.core.deposit import Depositor
from kvrag.core.protocol import BlendLimits
from kvrag.core.schedule import Planner
from kvrag.reuse.blend import DEFAULT_RECOMPUTE_RATIO
from kvrag.reuse.gate import BlendGate, GateResult, kl_divergence
from kvrag.trust.identity import EngineIdentity
from kvrag.trust.records import SealedRecords

__all__ = ["EngineGate"]


class EngineGate(BlendGate):
    """`BlendGate` with calibrating: each trial's continuations are run by `run` (the engine's)."""

    def __init__(self, identity: EngineIdentity, planner: Planner, records: SealedRecords, depositor: Depositor,
                 run: Callable[[Continuation], GenerationStream], *, limits: BlendLimits, deadline_s: float) -> None:
        super().__init__(identity, planner, records, depositor, limits=limits, deadline_s=deadline_s)
        self._run = run

    def calibrate(self, documents: Sequence[str] | None = None, questions: Sequence[str] | None = None, *,
                  ratio: float = DEFAULT_RECOMPUTE_RATIO, rerotate: bool = True, samples: int = 8,
                  max_mean_kl: float | None = None, min_agreement: float | None = None,
                  progress: Callable[[int, int], None] | None = None) -> GateResult:
        """Measure blends against the exact path on `samples` prompts built from `documents` (each
        followed by a question about it; default: the bundled sample set) and store the verdict.
        `max_mean_kl` and `min_agreement` may tighten the engine's limits, never loosen them;
        `progress(done, samples)` is called after each prompt."""
        max_mean_kl, min_agreement = self.tightened(max_mean_kl, min_agreement)
        kls: list[float] = []
        agreed = 0
        for exact_path, blend in self.trials(documents, questions, ratio=ratio, rerotate=rerotate, samples=samples):
            exact = self._run(exact_path).result().first_token_logits
            blended = self._run(blend).result().first_token_logits
            kls.append(kl_divergence(exact, blended))
            agreed += int(exact.argmax() == blended.argmax())
            if progress is not None:
                progress(len(kls), samples)
        return self.verdict(kls, agreed, ratio=ratio, rerotate=rerotate, max_mean_kl=max_mean_kl,
                            min_agreement=min_agreement)
