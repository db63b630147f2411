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

from typing import Any

import torch

__all__ = ["rerotation_refusal", "rope_inv_freq", "rerotate_keys"]

_ROTATE_HALF_FAMILIES = {"llama", "qwen2", "mistral", "phi3"}


def rerotation_refusal(hf_model: Any, has_sliding_layers: bool) -> str | None:
    """Why this model's states cannot be moved (None when they can)."""
    config = hf_model.config.get_text_config(decoder=True)
    if has_sliding_layers:
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
