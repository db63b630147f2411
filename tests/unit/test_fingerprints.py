import torch

from kvrag import HardwareFingerprint, ModelFingerprint, hardware_fingerprint, load_model

from ..conftest import tiny


def test_model_fingerprint_covers_numeric_settings():
    base = tiny("llama").fingerprint
    assert tiny("llama", "bfloat16").fingerprint.digest != base.digest
    assert tiny("llama", "float32", "eager").fingerprint.digest != base.digest
    assert tiny("qwen2").fingerprint.digest != base.digest
    assert base.rope is not None and base.transformers_version


def test_fingerprints_round_trip_through_json_and_ignore_stored_digests():
    fp = tiny("gemma3").fingerprint
    data = fp.model_dump()
    assert ModelFingerprint.model_validate(data).digest == fp.digest
    data["digest"] = "0" * 64  # a forged digest is dropped and recomputed
    assert ModelFingerprint.model_validate(data).digest == fp.digest
    hw = hardware_fingerprint()
    assert HardwareFingerprint.model_validate_json(hw.model_dump_json()).digest == hw.digest


def test_hardware_fingerprint_describes_the_cpu_and_follows_its_settings():
    hw = hardware_fingerprint()
    assert hw.device_type == "cpu" and hw.cpu_capability and hw.torch_version == torch.__version__
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, threads - 1) if threads > 1 else 2)
        assert hardware_fingerprint().digest != hw.digest
    finally:
        torch.set_num_threads(threads)
    assert hardware_fingerprint().digest == hw.digest


def test_weight_change_changes_the_fingerprint():
    model = load_model("tiny-random-phi3")
    fp = model.fingerprint.digest
    model.weights_sha256 = "0" * 64
    model.__dict__.pop("fingerprint")
    assert model.fingerprint.digest != fp
