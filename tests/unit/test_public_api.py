"""The public API is pinned: every exported name is kvrag's own object, under its own name."""

import inspect

import kvrag
from kvrag import errors

EXPECTED = {
    "load_model", "LoadedModel", "KVEngine", "Runtime", "StateRef", "Segment", "Continuation", "Generation", "GenerationStream",
    "Receipt", "StateUse", "Timings", "StateManifest", "ModelFingerprint", "HardwareFingerprint", "hardware_fingerprint",
    "open_store", "StateStore", "BlobStore", "DiskStore", "MemoryStore", "RedisStore", "TieredStore", "verify_model",
    "VerifyReport", "KVRagError", "InputError", "EmptyTextError", "ContextTooLongError", "ModelError", "StateError",
    "StateNotFoundError", "IntegrityError", "SignatureError", "ForeignStateError", "VerificationError", "StoreError",
    "StoreUnavailableError", "StoreTimeoutError", "StreamFailedError", "RedirectError", "Engine", "GenerationOptions", "EngineIdentity", "Message", "Provenance",
}
#: Each layer's package and what it exports (users and the adapters import only these).
PACKAGES = ["kvrag.kernels", "kvrag.models", "kvrag.artifacts", "kvrag.codecs", "kvrag.stores", "kvrag.stores.redis",
            "kvrag.trust", "kvrag.core", "kvrag.reuse", "kvrag.engine", "kvrag.apps", "kvrag.apps.ab", "kvrag.server",
            "kvrag.cli", "kvrag.data"]


def test_public_api_is_pinned():
    assert set(kvrag.__all__) == EXPECTED


def test_every_package_exports_what_it_lists():
    import importlib

    for name in PACKAGES:
        package = importlib.import_module(name)
        assert package.__doc__ and package.__all__, name
        missing = [n for n in package.__all__ if not hasattr(package, n)]
        assert missing == [], (name, missing)


def test_every_exported_name_is_a_kvrag_class_or_function_of_that_name():
    for name in kvrag.__all__:
        obj = getattr(kvrag, name)
        assert inspect.isclass(obj) or inspect.isfunction(obj), name
        assert obj.__name__ == name and obj.__module__.startswith("kvrag."), (name, obj.__module__)


def test_every_error_is_exported_from_errors_and_shares_one_root():
    exported = {n for n in kvrag.__all__ if inspect.isclass(getattr(kvrag, n)) and issubclass(getattr(kvrag, n), Exception)}
    assert exported == {n for n in errors.__all__ if inspect.isclass(getattr(errors, n))}
    for name in exported:
        assert getattr(kvrag, name) is getattr(errors, name) and issubclass(getattr(errors, name), kvrag.KVRagError)


def test_state_errors_name_a_documented_receipt_reason():
    from kvrag.core.receipt import REASONS

    classes = [getattr(errors, n) for n in errors.__all__ if inspect.isclass(getattr(errors, n))]
    state_errors = [e for e in classes if issubclass(e, errors.StateError)]
    assert {e.reason for e in state_errors} <= set(REASONS)
    assert not issubclass(errors.VerificationError, errors.StateError)  # nothing falls back from a failed deposit


def test_the_receipts_page_lists_exactly_the_receipt_reasons():
    import pathlib
    import re

    from kvrag.core.receipt import REASONS

    page = (pathlib.Path(__file__).parents[2] / "docs" / "concepts" / "receipts.md").read_text()
    listed = page.split("(closed set, `kvrag.core.receipt.REASONS`):", 1)[1].split(", with a detail", 1)[0]
    assert re.findall(r"`([a-z-]+)`", listed) == list(REASONS)
