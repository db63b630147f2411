"""The model runner: the one place that calls the model, picks tokens and hashes logits.

A forward call feeds one segment of ids into a cache and returns the last position's logits;
which ids are fed together is the schedule's business (see `kvrag.core.schedule`), since floating-point
results depend on it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvrag.codecs import GraftCache, LayerCodec, ReadyBuffers, codecs_for, new_cache
from kvrag.core.sampling import Sampler, Sampling
from kvrag.kernels.attention import INVARIANT, MIN_FORWARD_ROWS, PACKING, Packing
from kvrag.kernels.linear import rows_invariant
from kvrag.models.loading import LoadedModel

__all__ = ["ModelRunner", "logits_sha256", "DecodeStep", "PromptRead"]


def logits_sha256(logits: torch.Tensor) -> str:
    """SHA-256 of a logits tensor's bytes, exactly as computed (dtype kept)."""
    return hashlib.sha256(logits.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class DecodeStep:
    """One decoding step a generation asks for: feed `token` at `position` after what `cache` holds."""

    token: int
    position: int
    cache: Any


@dataclass(frozen=True)
class PromptRead:
    """A prompt read a generation asks for: feed `ids` after what `cache` holds, as `forward` does."""

    ids: Sequence[int]
    cache: Any


class _PackedCache:
    """The cache of a packed forward: each layer's new rows go, sequence by sequence, into that
    sequence's own cache, and the keys and values each then holds are left for the attention."""

    def __init__(self, caches: Sequence[Any], packing: Packing) -> None:
        self.caches, self.packing = caches, packing

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        self.packing.hold(layer_idx, [
            cache.update(key_states[:, :, a:b], value_states[:, :, a:b], layer_idx, *args, **kwargs)
            for cache, (a, b) in zip(self.caches, self.packing.spans)])
        return key_states, value_states


class ModelRunner:
    """Forward calls, greedy picks and fresh caches for one loaded model. Every forward runs in the
    model's turn (`LoadedModel.turns`): one at a time over the model, whichever thread or engine
    asks."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self.codecs: list[LayerCodec] = codecs_for(model.hf_model)
        self._vocab = len(model.tokenizer)
        #: token ids the model can read: rows of its input embedding
        self.vocabulary = model.vocabulary

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_cache(self, ready: ReadyBuffers | None = None) -> Any:
        return new_cache(self.model.hf_model, ready)

    def forward(self, ids: Sequence[int], cache: Any) -> torch.Tensor:
        """Feed prompt `ids` in one forward call after what `cache` holds; the last position's logits.

        Under the invariant kernel a read shorter than `MIN_FORWARD_ROWS` is padded with dummy
        tokens after it (their cache entries dropped), so its rows are computed as they would be
        in one pass over the whole prompt (see `kvrag.kernels.attention`)."""
        with self.model.turns.turn():
            feed, padding, held = self._padded(ids, cache)
            input_ids = torch.tensor([feed], dtype=torch.long, device=self.model.device)
            keep = torch.tensor([len(feed) - padding - 1], device=self.model.device) if padding else 1
            with torch.inference_mode():
                out = self.model.hf_model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=keep)
            if padding:
                self._unpad(cache, held, len(feed), padding)
            return out.logits[0, -1]

    def _padded(self, ids: Sequence[int], cache: Any) -> tuple[list[int], int, list[Any]]:
        """What a read of `ids` feeds: padded with dummy tokens if short (see `forward`), the padding,
        and what `cache`'s layers held before it, to undo the padding after."""
        ids = list(ids)
        padding = self._padding(len(ids))
        if not padding:
            return ids, 0, []
        if isinstance(cache, GraftCache):  # a deferred graft is installed before its layers are read here
            cache.settle()
        held = [(layer.keys, layer.values) if layer.is_initialized else None for layer in cache.layers]
        return ids + [ids[-1]] * padding, padding, held

    def _unpad(self, cache: Any, held: list[Any], added: int, padding: int) -> None:
        held = held + [None] * (len(cache.layers) - len(held))  # layers a lazy cache made just now
        for codec, layer, before in zip(self.codecs, cache.layers, held):
            codec.unpad(layer, before, added, padding)

    def step(self, token: int, cache: Any) -> torch.Tensor:
        """One decoding step (one row, never padded: as a stock `model.generate` decodes)."""
        input_ids = torch.tensor([[token]], dtype=torch.long, device=self.model.device)
        with self.model.turns.turn(), torch.inference_mode():
            out = self.model.hf_model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    @property
    def batches_exactly(self) -> bool:
        """Whether `step_many` gives every row the bits `step` gives it alone: under the invariant
        kernel, whose linear layers' rows do not depend on the row count (`rows_invariant`)."""
        return self.model.attn == INVARIANT and rows_invariant(self.model.dtype)

    @property
    def packs_reads(self) -> bool:
        """Whether `step_many` packs prompt reads beside the steps: where it batches exactly and no
        layer slides (a sliding layer's rows would need the window's mask, which packing leaves out)."""
        return self.batches_exactly and all(codec.window is None for codec in self.codecs)

    def step_many(self, steps: Sequence[DecodeStep | PromptRead]) -> list[torch.Tensor]:
        """One decoding step or prompt read for each of several generations, in one forward call
        where that is exact (`batches_exactly`; prompt reads where `packs_reads`), the rest one call
        each; each one's logits, as `step` or `forward` gives them alone."""
        together, alone = self._partition(steps)
        with self.model.turns.turn():  # the whole batch in one turn: nothing runs between its forwards
            logits = dict(zip(map(id, together), self._packed(together))) if together else {}
            for s in alone:
                logits[id(s)] = self.step(s.token, s.cache) if isinstance(s, DecodeStep) else self.forward(s.ids, s.cache)
        return [logits[id(s)] for s in steps]

    def forward_calls(self, steps: Sequence[DecodeStep | PromptRead]) -> int:
        """How many forward calls `step_many(steps)` runs."""
        together, alone = self._partition(steps)
        return len(alone) + bool(together)

    def _partition(self, steps: Sequence[DecodeStep | PromptRead]) -> tuple[list[Any], list[Any]]:
        """The steps `step_many` packs in one forward, and those it runs alone (a single one: alone)."""
        together: list[Any] = []
        alone: list[Any] = []
        for s in steps:
            packs = self.batches_exactly if isinstance(s, DecodeStep) else self.packs_reads
            (together if len(steps) > 1 and packs else alone).append(s)
        return together, alone

    def _packed(self, steps: Sequence[DecodeStep | PromptRead]) -> list[torch.Tensor]:
        """One forward over every step's and read's rows side by side (`Packing`); a short read
        padded as `forward` pads it, its padding undone after."""
        ids: list[int] = []
        positions: list[int] = []
        spans, keep, undo = [], [], []
        for s in steps:
            if isinstance(s, DecodeStep):
                feed, first, padding = [s.token], s.position, 0
            else:
                if isinstance(s.cache, GraftCache):  # deferred grafts in place before the positions are counted
                    s.cache.settle()
                first = s.cache.get_seq_length()
                feed, padding, held = self._padded(s.ids, s.cache)
                if padding:
                    undo.append((s.cache, held, len(feed), padding))
            spans.append((len(ids), len(ids) + len(feed)))
            keep.append(len(ids) + len(feed) - padding - 1)
            ids += feed
            positions += range(first, first + len(feed))
        device, rows = self.model.device, len(ids)
        packing = Packing(spans)
        # a prepared mask stops transformers from making one; the packing's attention never reads it
        mask = torch.ones((1, 1, rows, rows), dtype=torch.bool, device=device)
        with torch.inference_mode():
            out = self.model.hf_model(input_ids=torch.tensor([ids], dtype=torch.long, device=device),
                                      position_ids=torch.tensor([positions], dtype=torch.long, device=device),
                                      attention_mask=mask, cache=_PackedCache([s.cache for s in steps], packing),
                                      use_cache=True, logits_to_keep=torch.tensor(keep, device=device),
                                      **{PACKING: packing})
        for cache, held, added, padding in undo:
            self._unpad(cache, held, added, padding)
        return list(out.logits[0])

    def _padding(self, rows: int) -> int:
        if self.model.attn != INVARIANT or rows >= MIN_FORWARD_ROWS or rows == 0:
            return 0
        padding = MIN_FORWARD_ROWS - rows
        # a sliding layer keeps window - 1 positions: the padded read must fit in it to be undone
        if any(codec.window is not None and codec.window - 1 < MIN_FORWARD_ROWS for codec in self.codecs):
            return 0
        return padding

    def forward_at(self, ids: Sequence[int], positions: Sequence[int] | torch.Tensor, cache: Any,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed `ids` at explicit `positions` (not necessarily contiguous), optionally under a
        prepared 4D additive `attention_mask`; the last position's logits (see `kvrag.reuse.blend`)."""
        device = self.model.device
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
        position_ids = torch.as_tensor(positions, dtype=torch.long, device=device).reshape(1, -1)
        with self.model.turns.turn(), torch.inference_mode():
            out = self.model.hf_model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                      cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def sampler(self, sampling: Sampling | None = None) -> Sampler:
        """A token chooser for one generation (greedy unless `sampling` says otherwise)."""
        return Sampler(sampling or Sampling(), self._vocab)
