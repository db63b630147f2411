"""Opt-in approximate composition: a state moved to another offset, keys re-rotated.

A state computed after one prefix and moved after another cannot reproduce a fresh computation:
its K/V encode the context it was computed in, and with floating-point rotary encodings even a
pure shift does not round-trip bit for bit. kvrag only does this when asked, labels the receipt
`approximate-graft` (`exact=False`), and measures the cost (KL, argmax agreement) in its tests.

For rotary models using the rotate-half convention with default RoPE, keys stored at position p
become keys at p + delta by one more rotation by delta, since rotations compose. Models with
absolute positions (GPT-2) or sliding-window layers are refused; their segments are re-read.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kvrag.artifacts.format import tensor_names
from kvrag.codecs import LayerCodec, StatePart
from kvrag.core.acceptance import Restored
from kvrag.core.prefill import Graftable
from kvrag.core.schedule import Segment
from kvrag.errors import ForeignStateError
from kvrag.stores import Found

__all__ = ["rerotation_refusal", "rope_inv_freq", "rerotate_keys", "moved_graft"]

_ROTATE_HALF_FAMILIES = {"llama", "qwen2", "mistral", "phi3"}


def rerotation_refusal(hf_model: Any, has_unmovable_layers: bool) -> str | None:
    """Why this model's states cannot be moved (None when they can)."""
    config = hf_model.config.get_text_config(decoder=True)
    if has_unmovable_layers:
        return "states with sliding-window layers cannot be moved"
    if config.model_type not in _ROTATE_HALF_FAMILIES:
        return f"{config.model_type} states cannot be moved: absolute positions or an unsupported rotary layout"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        return f"rope type {rope.get('rope_type')!r} cannot be re-rotated"
    if rope_inv_freq(hf_model) is None:
        return "the model exposes no rotary frequencies"
    return None


def rope_inv_freq(hf_model: Any) -> torch.Tensor | None:
    rotary = getattr(getattr(hf_model, "model", None), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    return inv_freq.detach().float() if isinstance(inv_freq, torch.Tensor) else None


def rerotate_keys(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate keys `[batch, heads, tokens, head_dim]` by `delta` positions (a new tensor)."""
    if delta == 0:
        return keys.clone()
    angles = float(delta) * inv_freq.to(keys.device, torch.float64)
    emb = torch.cat([angles, angles]).to(torch.float32)
    cos, sin = emb.cos(), emb.sin()
    k = keys.float()
    half = k.shape[-1] // 2
    rotated_half = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    return (k * cos + rotated_half * sin).to(keys.dtype)


def moved_graft(hf_model: Any, codecs: Sequence[LayerCodec], source: Found[Restored], doc_ids: Sequence[int],
                segment: Segment, *, rerotate: bool = True) -> Graftable:
    """`source`'s document K/V (its last `len(doc_ids)` positions) moved to `segment`'s position:
    approximate, never exact. Raises `ForeignStateError` when the model's states cannot move.
    `rerotate=False` leaves the keys at their old positions' rotation (worse; for measuring)."""
    refusal = rerotation_refusal(hf_model, not all(c.movable for c in codecs))
    if refusal:
        raise ForeignStateError(refusal)
    manifest = source.value.manifest
    n = len(doc_ids)
    if manifest.token_ids[-n:] != list(doc_ids):
        raise ForeignStateError(f"state {manifest.key[:12]} does not end with this document's tokens")
    stored = source.value.part.tensors
    new_start = segment.end - n
    delta = new_start - (manifest.end - n)
    inv_freq = rope_inv_freq(hf_model)
    assert inv_freq is not None  # rerotation_refusal said so
    tensors = {}
    for index in range(len(codecs)):
        key_name, value_name = tensor_names(index)
        tensors[key_name] = rerotate_keys(stored[key_name][:, :, -n:, :], delta if rerotate else 0, inv_freq)
        tensors[value_name] = stored[value_name][:, :, -n:, :]
    return Graftable(StatePart(new_start, segment.end, manifest.layers, tensors), source.tier, source.notes,
                 segment.ids[: len(segment.ids) - n])
