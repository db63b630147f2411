"""`kvrag verify`: measure, per model, that a grafted state reproduces a fresh computation.

For each (document, question) sample the document is deposited (itself verified by its canary),
then three first-token logits are compared:

- graft: the engine's answer path, the state restored from its stored bytes;
- fresh: the same ids, from scratch, in the same segments ([prefix+doc] then [question]),
  with plain transformers calls (the model's forward over a new `DynamicCache`, segment by
  segment: no kvrag code, so the graft is never checked against its own path);
- monolithic: the same ids in ONE stock transformers forward pass (`model(input_ids)`), as a
  user's own text RAG would run them.

Graft against fresh must be byte-exact. Graft against monolithic is reported as measured: with
sdpa or eager it usually differs in the last bits on a CPU (never called exact); the invariant
kernel (`attn="invariant"`, `kvrag.kernels.attention`) aims to make it byte-exact, which this column shows
or refutes per model (see the README: not yet for smollm2-135m).

Chains are checked too: a chain is deposited the engine's way (each state computed after its
ancestors' grafted states), then every state's K/V are recomputed from scratch with the same
plain transformers calls, all segments in order, and the payload's SHA-256 must equal the stored one.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from pydantic import BaseModel
from transformers import DynamicCache

from kvrag.artifacts.format import encode_payload, parse_manifest, sha256_hex
from kvrag.codecs import extract
from kvrag.core.runner import logits_sha256
from kvrag.data import verification_pairs
from kvrag.engine.engine import KVEngine
from kvrag.errors import VerificationError
from kvrag.models.loading import LoadedModel
from kvrag.stores import MemoryStore
from kvrag.trust.confidential import open_manifest

__all__ = ["Agreement", "VerifyReport", "verify_model"]


class Agreement(BaseModel):
    samples: int
    byte_exact: int
    kl_max: float
    argmax_agreement: float
    max_abs_diff: float


class VerifyReport(BaseModel):
    model: str
    dtype: str
    attn: str
    device: str
    samples: int
    byte_exact: int
    kl_max: float
    argmax_agreement: float
    max_abs_diff: float
    fallback_byte_exact: int
    monolithic: Agreement
    chain_states: int = 0
    chain_states_byte_exact: int = 0
    prompt_tokens_min: int
    prompt_tokens_max: int
    model_fingerprint: str
    hardware_fingerprint: str


class _Tally:
    def __init__(self) -> None:
        self.n = self.exact = self.argmax = 0
        self.kl_max = self.diff_max = 0.0

    def add(self, reference: torch.Tensor, candidate: torch.Tensor) -> None:
        self.n += 1
        self.exact += logits_sha256(reference) == logits_sha256(candidate)
        self.argmax += int(torch.argmax(reference)) == int(torch.argmax(candidate))
        p = torch.log_softmax(reference.double(), -1)
        q = torch.log_softmax(candidate.double(), -1)
        kl = float(torch.sum(p.exp() * (p - q)))
        self.kl_max = max(self.kl_max, 0.0 if kl < 0 and math.isclose(kl, 0.0, abs_tol=1e-12) else kl)
        self.diff_max = max(self.diff_max, float((reference.double() - candidate.double()).abs().max()))

    def agreement(self) -> Agreement:
        return Agreement(
            samples=self.n,
            byte_exact=self.exact,
            kl_max=self.kl_max,
            argmax_agreement=self.argmax / self.n if self.n else 0.0,
            max_abs_diff=self.diff_max,
        )


def _stock_forward(model: LoadedModel, ids: list[int], cache: DynamicCache) -> torch.Tensor:
    """One plain transformers forward of `ids` after what `cache` holds (no kvrag code): the last
    position's logits."""
    with model.turns.turn(), torch.inference_mode():  # the model's turn, as every forward over it
        out = model.hf_model(input_ids=torch.tensor([ids], device=model.device), cache=cache,
                             use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


def _stock_cache(model: LoadedModel) -> DynamicCache:
    return DynamicCache(config=model.hf_model.config)


def _chain_check(engine: KVEngine, documents: list[str]) -> tuple[int, int]:
    """(states, byte-exact states) of a chain deposited by the engine against a from-scratch run
    of plain transformers calls."""
    refs = engine.deposit_chain(documents)
    cache = _stock_cache(engine.model)
    exact = 0
    for segment in engine.plan(documents):
        _stock_forward(engine.model, segment.ids, cache)
        _, tensors = extract(engine.runner.codecs, cache, segment.start, segment.end)
        stored = parse_manifest(open_manifest(engine.store.read_manifest(segment.key) or b"", engine.signing_key, segment.key))
        exact += sha256_hex(encode_payload(tensors)) == stored.payload_sha256
    return len(refs), exact


def _one_stock_pass(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    """The last position's logits of one stock transformers forward over `ids` (no kvrag code)."""
    with model.turns.turn(), torch.inference_mode():
        return model.hf_model(input_ids=torch.tensor([ids], device=model.device), logits_to_keep=1).logits[0, -1]


def verify_model(
    model: LoadedModel, *, samples: int = 50, progress: Callable[[int, int], None] | None = None
) -> VerifyReport:
    """Run the graft / fresh / monolithic / fallback comparison over `samples` bundled pairs."""
    store = MemoryStore()
    engine = KVEngine(model, store)
    text_only = KVEngine(model, MemoryStore())  # empty store: every state falls back to text
    fresh_tally, mono_tally = _Tally(), _Tally()
    fallback_exact = 0
    lengths: list[int] = []
    for index, (document, question) in enumerate(verification_pairs(samples, model.tokenizer)):
        ref = engine.deposit(document)
        graft = engine.generate(question, states=[ref], max_new_tokens=1)
        if graft.receipt.mode != "exact-graft":
            raise VerificationError(f"sample {index}: expected an exact graft, got {graft.receipt.mode}")
        segment = engine.plan([document])[0].ids
        query = engine.layout.question_ids(question)
        lengths.append(len(segment) + len(query))

        cache = _stock_cache(model)
        _stock_forward(model, segment, cache)
        fresh = _stock_forward(model, query, cache)
        monolithic = _one_stock_pass(model, segment + query)
        fallback = text_only.generate(question, states=[document], max_new_tokens=1)

        fresh_tally.add(fresh, graft.first_token_logits)
        mono_tally.add(monolithic, graft.first_token_logits)
        fallback_exact += fallback.receipt.first_token_logits_sha256 == graft.receipt.first_token_logits_sha256
        if progress:
            progress(index + 1, samples)
    chains = max(1, samples // 10)
    # three-sentence documents; for a model with sliding-window layers, whole documents (about
    # 200-270 tokens each with a BPE tokenizer), so that a chain is longer than gemma3-270m's
    # 512-token window and the later states' windows reach back into their parents
    size = 2 if "sliding_attention" in (getattr(model.config, "layer_types", None) or ()) else 1
    pool = [d for i, (d, _) in enumerate(verification_pairs(15 * chains, model.tokenizer)) if i % 5 == size]
    chain_states = chain_exact = 0
    for c in range(chains):
        states, exact = _chain_check(KVEngine(model, MemoryStore()), pool[3 * c : 3 * c + 3])
        chain_states, chain_exact = chain_states + states, chain_exact + exact
    result = fresh_tally.agreement()
    return VerifyReport(
        model=model.name,
        dtype=str(model.dtype).removeprefix("torch."),
        attn=model.attn,
        device=str(model.device),
        samples=result.samples,
        byte_exact=result.byte_exact,
        kl_max=result.kl_max,
        argmax_agreement=result.argmax_agreement,
        max_abs_diff=result.max_abs_diff,
        fallback_byte_exact=fallback_exact,
        monolithic=mono_tally.agreement(),
        chain_states=chain_states,
        chain_states_byte_exact=chain_exact,
        prompt_tokens_min=min(lengths, default=0),
        prompt_tokens_max=max(lengths, default=0),
        model_fingerprint=model.fingerprint.digest,
        hardware_fingerprint=engine.identity.hardware.digest,
    )
