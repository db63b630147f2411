
import pytest

from kvrag import DiskStore, KVEngine, MemoryStore, StoreError, open_store

from ..conftest import DOC_A, QUESTION, tiny

KEY = "ab" + "0" * 62


def test_open_store_by_url(tmp_path):
    assert isinstance(open_store("memory://"), MemoryStore)
    disk = open_store(f"disk://{tmp_path}")
    assert isinstance(disk, DiskStore) and disk.root == tmp_path
    for bad in ("nothing", "ftp://x", "disk://"):
        with pytest.raises(StoreError):
            open_store(bad)


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_invalid_keys_are_refused(kind, tmp_path):
    store = MemoryStore() if kind == "memory" else DiskStore(tmp_path)
    for key in ("../etc/passwd", "ABC", "a" * 63):
        with pytest.raises(StoreError):
            store.read_manifest(key)


def test_disk_store_writes_atomically_and_reads_whole_files(tmp_path):
    store = DiskStore(tmp_path)
    assert store.read_manifest(KEY) is None and store.read(KEY) is None
    store.put(KEY, b"{}", b"payload-bytes")
    assert store.read_manifest(KEY) == b"{}"
    payload = store.read(KEY).payload
    assert bytes(payload) == b"payload-bytes"
    payload[0:1] = b"X"  # a copy in process memory: the file is untouched
    assert bytes(store.read(KEY).payload) == b"payload-bytes"
    with open(next(tmp_path.rglob("*.kvstate")), "rb") as f:
        data = f.read()
    assert data.index(b"payload-bytes") % 4096 == 0  # page-aligned payload
    assert list(store.keys()) == [KEY]  # listed; `KEY in store` asks for a whole state, which b"{}" is not
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()]  # no temporary files left behind
    store.delete(KEY)
    assert store.read_manifest(KEY) is None and list(store.keys()) == []


def test_engine_on_a_disk_store_survives_a_new_process_view(tmp_path):
    engine = KVEngine(tiny("mistral"), f"disk://{tmp_path}")
    ref = engine.deposit(DOC_A)
    reopened = KVEngine(tiny("mistral"), DiskStore(tmp_path))
    graft = reopened.generate(QUESTION, states=[ref], max_new_tokens=3)
    text = reopened.generate(QUESTION, states=[ref], max_new_tokens=3, graft=False)
    assert graft.receipt.mode == "exact-graft" and graft.receipt.states[0].tier == f"disk://{tmp_path}"
    assert graft.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256


def test_a_damaged_state_file_is_refused(tmp_path):
    engine = KVEngine(tiny("llama"), DiskStore(tmp_path))
    ref = engine.deposit(DOC_A)
    path = next(tmp_path.rglob("*.kvstate"))
    path.write_bytes(path.read_bytes()[:-100])  # a truncated file: the payload hash fails
    receipt = engine.generate(QUESTION, states=[ref], max_new_tokens=2).receipt
    assert receipt.mode == "text-prefill" and receipt.states[0].reason == "integrity"
    path.write_bytes(b"garbage")
    receipt = engine.generate(QUESTION, states=[ref], max_new_tokens=2).receipt
    assert receipt.mode == "text-prefill" and receipt.states[0].reason == "integrity"


def test_a_state_error_names_its_key_and_the_tier_that_refused_it(tmp_path):
    from kvrag import IntegrityError, StateNotFoundError

    disk = f"disk://{tmp_path}"
    engine = KVEngine(tiny("llama"), disk)
    absent = engine.ref("A document nobody deposited.")
    with pytest.raises(StateNotFoundError) as missing:
        engine.restore(absent)
    assert (missing.value.key, missing.value.tier, missing.value.reason) == (absent.key, disk, "missing")
    ref = engine.deposit(DOC_A)
    path = next(tmp_path.rglob("*.kvstate"))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(IntegrityError) as damaged:
        engine.restore(ref)
    assert (damaged.value.key, damaged.value.tier, damaged.value.reason) == (ref.key, disk, "integrity")


def test_a_read_past_its_deadline_is_a_store_timeout_error():
    import threading

    from kvrag import StoreTimeoutError, StoreUnavailableError
    from kvrag.stores.deadline import Deadline, bounded

    release = threading.Event()
    try:
        with pytest.raises(StoreTimeoutError) as late:
            bounded(lambda: release.wait(30), Deadline(0.05), "a read that never ends")
    finally:
        release.set()
    assert isinstance(late.value, StoreUnavailableError) and late.value.reason == "unavailable"
