"""Tiny random models: real architectures, a few hundred kilobytes, built offline in milliseconds.

They exist so that tests (kvrag's and yours) cover many attention layouts quickly. The weights are
drawn from NumPy's PCG64 generator seeded by the model name and parameter name, so the same name
gives the same weight bytes on every machine. The tokenizer is byte-level (every UTF-8 byte is a
token, plus ChatML specials): it needs no files and splits everywhere, so segment boundaries are
always natural.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import numpy as np
import torch

from kvrag.errors import ModelError

__all__ = ["TINY_FAMILIES", "build_tiny_model", "build_byte_tokenizer"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 320  # 256 bytes + specials, rounded up
MAX_POSITIONS = 4096
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=MAX_POSITIONS,
    bos_token_id=0,
    eos_token_id=258,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_COMMON)


def _qwen2() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**_COMMON)


def _mistral() -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_COMMON, sliding_window=None)


def _phi3() -> Any:
    from transformers import Phi3Config

    return Phi3Config(**_COMMON, original_max_position_embeddings=MAX_POSITIONS)


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    # Two sliding-window layers and one global layer; a 32-token window is far shorter than
    # the test documents, so a state's sliding layers hold only the window's tail.
    return Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 3, "tie_word_embeddings": True},
        head_dim=16,
        sliding_window=32,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
    )


def _gpt2() -> Any:
    from transformers import GPT2Config

    # Absolute (learned) positions: no rotary encoding, so moving a state is never exact.
    names = {"n_positions": "max_position_embeddings", "n_embd": "hidden_size", "n_layer": "num_hidden_layers",
             "n_head": "num_attention_heads"}
    return GPT2Config(vocab_size=VOCAB_SIZE, bos_token_id=_COMMON["bos_token_id"], eos_token_id=_COMMON["eos_token_id"],
                      **{gpt2: _COMMON[common] for gpt2, common in names.items()})


TINY_FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "mistral": _mistral,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "gpt2": _gpt2,
}


def _seeded_values(model_name: str, param_name: str, shape: tuple[int, ...]) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(f"{model_name}/{param_name}".encode()).digest()[:8], "little")
    rng = np.random.Generator(np.random.PCG64(seed))
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.08)
    if len(shape) == 1 and ("norm" in param_name or "ln_" in param_name):
        values += np.float32(1.0)
    return values


def build_tiny_model(family: str, *, dtype: torch.dtype, attn: str) -> torch.nn.Module:
    """Build `tiny-random-<family>` with deterministic weights, in eval mode."""
    from transformers import AutoModelForCausalLM

    if family not in TINY_FAMILIES:
        known = ", ".join(f"tiny-random-{name}" for name in TINY_FAMILIES)
        raise ModelError(f"unknown tiny model family {family!r}; choose one of: {known}")
    config = TINY_FAMILIES[family]()
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    name = f"tiny-random-{family}"
    with torch.no_grad():
        for param_name, param in sorted(model.named_parameters()):
            param.copy_(torch.from_numpy(_seeded_values(name, param_name, tuple(param.shape))))
    model.config.name_or_path = name
    return model.to(dtype).eval()


def build_byte_tokenizer() -> Any:
    """A byte-level tokenizer with ChatML special tokens and template, built without any files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    for offset, token in enumerate(SPECIAL_TOKENS):
        vocab[token] = 256 + offset
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer
