import kvrag

EXPECTED = {
    "load_model", "LoadedModel", "KVEngine", "StateRef", "Generation", "Receipt", "StateUse", "Timings",
    "StateManifest", "ModelFingerprint", "HardwareFingerprint", "hardware_fingerprint", "open_store",
    "StateStore", "DiskStore", "MemoryStore", "verify_model", "VerifyReport", "KVRagError", "InputError",
    "EmptyTextError", "ContextTooLongError", "ModelError", "StateError", "StateNotFoundError",
    "IntegrityError", "ForeignStateError", "VerificationError", "StoreError", "StoreUnavailableError",
    "RedisStore", "TieredStore",
}


def test_public_api_is_pinned():
    assert set(kvrag.__all__) == EXPECTED
    for name in kvrag.__all__:
        assert getattr(kvrag, name) is not None


def test_every_error_shares_one_root():
    for name in kvrag.__all__:
        obj = getattr(kvrag, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, kvrag.KVRagError)
