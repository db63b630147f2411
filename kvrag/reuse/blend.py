"""Blend (approximate, opt-in): a document's state computed on its own, moved to where the prompt
needs it and partly recomputed so that it attends to the documents before it, CacheBlend-style.

A state moved after other documents holds K/V computed without them. Blending picks the tokens
whose K/V deviate most from an exact computation at an early layer (one extra pass through the
first two layers only) and recomputes those tokens through every layer, attending to the context
and to the moved K/V of the others; their new K/V replace the moved ones. The rest stays moved.
The result is never exact: the receipt says `approximate-graft` with the share recomputed, and
`kvrag.reuse.gate` measures KL and argmax agreement against the exact path before a model may blend.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from kvrag.artifacts.format import tensor_names
from kvrag.codecs import StatePart
from kvrag.core.prefill import Graftable, Prefill
from kvrag.core.runner import ModelRunner

__all__ = ["DEFAULT_RECOMPUTE_RATIO", "select_tokens", "recompute", "blend_into"]

#: The share of a moved document's tokens recomputed by default.
DEFAULT_RECOMPUTE_RATIO = 0.15


class _Captured(Exception):
    """Stops a probe forward once the probed layer's K/V have been computed."""


class _ProbeCache(DynamicCache):
    """A cache that records the new K/V of one layer and stops the forward there."""

    probe: int = -1
    captured: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == self.probe:
            self.captured = (key_states, value_states)
            raise _Captured
        return out


def select_tokens(runner: ModelRunner, context: Any, ids: Sequence[int], start: int, moved: StatePart,
                  ratio: float) -> list[int]:
    """Indices (into `ids`) of the `ratio` share of tokens whose K/V at layer 1 deviate most
    between an exact computation after `context` (a cache holding positions [0, start)) and the
    `moved` part, in order."""
    count = min(len(ids), max(1, math.ceil(ratio * len(ids))))
    if count >= len(ids):
        return list(range(len(ids)))
    probe = min(1, len(runner.codecs) - 1)
    scratch = _ProbeCache(config=runner.model.hf_model.config)
    for index in range(probe + 1):
        layer = context.layers[index]
        scratch.update(layer.keys[:, :, :start], layer.values[:, :, :start], index)
    scratch.probe = probe
    try:
        runner.forward_at(ids, range(start, start + len(ids)), scratch)
    except _Captured:
        pass
    assert scratch.captured is not None, "the probe layer was never reached"
    keys, values = scratch.captured
    key_name, value_name = tensor_names(probe)
    deviation = ((keys.float() - moved.tensors[key_name].to(keys.device).float()) ** 2).sum(dim=(0, 1, 3))
    deviation += ((values.float() - moved.tensors[value_name].to(values.device).float()) ** 2).sum(dim=(0, 1, 3))
    return sorted(torch.topk(deviation, count).indices.tolist())


def recompute(runner: ModelRunner, cache: Any, ids: Sequence[int], start: int, selected: Sequence[int]) -> None:
    """Recompute the K/V of `ids[selected]` (the segment at `start`, its moved K/V already in
    `cache`, which ends with it) through every layer, in place.

    One forward over the selected tokens at their own positions: each attends to the context, to
    the moved K/V of the unselected tokens before it, and to the new K/V of the selected tokens
    before it (never to its own or another selected token's moved K/V)."""
    if not selected:
        return
    end = start + len(ids)
    device, dtype = runner.device, runner.model.dtype
    chosen = torch.tensor(list(selected), device=device)
    total = end + len(selected)
    allowed = torch.zeros(len(selected), total, dtype=torch.bool, device=device)
    allowed[:, :start] = True
    offsets = torch.arange(len(ids), device=device)
    unselected = torch.ones(len(ids), dtype=torch.bool, device=device)
    unselected[chosen] = False
    allowed[:, start:end] = (offsets.unsqueeze(0) <= chosen.unsqueeze(1)) & unselected.unsqueeze(0)
    allowed[:, end:] = chosen.unsqueeze(0) <= chosen.unsqueeze(1)
    mask = torch.zeros(1, 1, len(selected), total, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    runner.forward_at([ids[i] for i in selected], chosen + start, cache, mask)
    with torch.inference_mode():
        for layer in cache.layers:
            keys, values = layer.keys.clone(), layer.values.clone()
            keys[:, :, start + chosen] = keys[:, :, end:]
            values[:, :, start + chosen] = values[:, :, end:]
            layer.keys, layer.values = keys[:, :, :end].contiguous(), values[:, :, :end].contiguous()


def blend_into(run: Prefill, fetched: Graftable, ids: Sequence[int], ratio: float) -> tuple[Graftable, int]:
    """Graft a moved part into `run` (`fetched`, holding the K/V of `ids`), then recompute the
    `ratio` share of its tokens whose K/V deviate most; the graft and how many tokens were recomputed."""
    run.admit(fetched)
    run.flush()
    part = fetched.part
    t = time.perf_counter()
    selected = select_tokens(run.runner, run.cache, ids, part.start, part, ratio)
    run.pending.append(part)
    run.flush()
    recompute(run.runner, run.cache, ids, part.start, selected)
    run.prefill_s += time.perf_counter() - t
    run.reused += part.end - part.start - len(selected)
    run.prefilled += len(selected)
    return fetched, len(selected)
