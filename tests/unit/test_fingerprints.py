import pytest
import torch

from kvrag import HardwareFingerprint, KVEngine, MemoryStore, ModelFingerprint, hardware_fingerprint, load_model

from ..conftest import DOC_A, DTYPES, FAMILIES, QUESTION, tiny


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


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_under_the_invariant_kernel_bits_and_keys_do_not_depend_on_the_thread_count(family, dtype):
    """The claim the fingerprint makes by leaving the thread count out: the same prompt at 1 and 2
    threads gives the same first-token logits byte for byte, and a state deposited at 2 threads
    grafts at 1, exactly."""
    model = tiny(family, dtype, "invariant")
    store = MemoryStore()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = KVEngine(model, store)
        ref = two.deposit(DOC_A)
        at_two = two.generate(QUESTION, states=[DOC_A], max_new_tokens=1, graft=False).receipt.first_token_logits_sha256
        torch.set_num_threads(1)
        one = KVEngine(model, store)
        assert one.identity.hardware == two.identity.hardware and one.identity.hardware.num_threads is None
        assert one.ref(DOC_A).key == ref.key
        at_one = one.generate(QUESTION, states=[DOC_A], max_new_tokens=1, graft=False).receipt.first_token_logits_sha256
        grafted = one.generate(QUESTION, states=[ref], max_new_tokens=1, memo=False)
    finally:
        torch.set_num_threads(threads)
    assert at_one == at_two
    assert grafted.receipt.mode == "exact-graft" and grafted.receipt.first_token_logits_sha256 == at_two


def test_under_sdpa_the_thread_count_stays_in_the_keys():
    model = tiny("llama", attn="sdpa")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = KVEngine(model, MemoryStore())
        torch.set_num_threads(1)
        one = KVEngine(model, two.store)
    finally:
        torch.set_num_threads(threads)
    assert (one.identity.hardware.num_threads, two.identity.hardware.num_threads) == (1, 2)
    assert one.ref(DOC_A).key != two.ref(DOC_A).key


def test_states_of_the_earlier_invariant_kernels_are_never_found():
    """The kernel's name in the fingerprint changed with its bits (last: on torch's flash attention): a state
    keyed under an earlier name is addressed elsewhere, so it is never grafted."""
    from kvrag.trust.identity import EngineIdentity

    model = tiny("llama", "float32", "invariant")
    now = model.fingerprint
    assert now.attn_implementation == "invariant/3"
    key = b"k" * 32
    current = EngineIdentity.of(now, "cpu", key, "")
    for earlier in ("invariant", "invariant+rows16", "invariant+rows16kn", "invariant/2"):
        old = now.model_copy(update={"attn_implementation": earlier})
        assert old.digest != now.digest
        assert EngineIdentity.of(old, "cpu", key, "").scope != current.scope


def test_an_upgrade_of_torch_or_transformers_changes_the_fingerprints():
    """What docs/guides/upgrades.md tells operators: states made under another torch or
    transformers version are not found (their keys hash these fingerprints) and are read again."""
    fp = tiny("llama").fingerprint
    assert ModelFingerprint.model_validate({**fp.model_dump(), "transformers_version": "99.0.0"}).digest != fp.digest
    hw = hardware_fingerprint()
    assert HardwareFingerprint.model_validate({**hw.model_dump(), "torch_version": "99.0.0"}).digest != hw.digest
    assert HardwareFingerprint.model_validate({**hw.model_dump(), "cpu_capability": "DEFAULT"}).digest != hw.digest


def test_what_a_fingerprint_holds_and_every_kernel_name_are_in_the_changelog(monkeypatch):
    """A change to a fingerprint's fields or to a kernel's name changes every key: the changelog
    must flag it ("Fingerprints changed"), then this pin is updated with it."""
    from pathlib import Path

    from kvrag.models import fingerprints

    changelog = (Path(__file__).parents[2] / "CHANGELOG.md").read_text(encoding="utf-8")
    assert sorted(ModelFingerprint.model_fields) == [
        "attn_implementation", "chat_template_sha256", "config_sha256", "dtype", "name", "rope", "tokenizer_sha256",
        "transformers_version", "weights_sha256"]
    assert sorted(HardwareFingerprint.model_fields) == [
        "blas", "compute_capability", "cpu_capability", "cuda_version", "deterministic_algorithms", "device_name",
        "device_type", "num_threads", "torch_version"]
    for kernel in ("onednn", "stock", "onednn-f32", "onednn-capped", "onednn-amx"):
        monkeypatch.setattr(fingerprints, "linear_kernel", lambda dtype, kernel=kernel: kernel)
        assert f"`{fingerprints.kernel_name('invariant', torch.float32)}`" in changelog
    assert "### Fingerprints changed" in changelog
