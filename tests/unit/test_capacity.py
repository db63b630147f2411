"""Bounded tiers: what a full memory or disk tier drops first, that a capped disk tier stays within
its cap under a deposit loop, and that readers during eviction see whole states or misses."""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrag import KVEngine
from kvrag.apps.maintenance import collect_garbage
from kvrag.errors import StoreError
from kvrag.stores import DiskStore, MemoryStore, open_store
from kvrag.stores.capacity import Uses, capacity_params

from ..conftest import DOC_A, DOC_B, DOC_C, tiny


def manifest(size: int) -> bytes:
    return b'{"payload_bytes": %d}' % size


def key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def payload(name: str, size: int) -> bytes:
    """Bytes that say which state they are: a reader can tell a whole state from a mixed one."""
    block = hashlib.sha256(name.encode()).digest()
    return (block * (size // len(block) + 1))[:size]


def disk(tmp_path, cap: int, eviction: str = "lru") -> DiskStore:
    return DiskStore(tmp_path, max_bytes=cap, eviction=eviction)  # type: ignore[arg-type]


def file_size(store: DiskStore, size: int) -> int:
    """What one state of `size` payload bytes takes on disk (its header is padded to 4 KiB)."""
    store.put(key("probe"), manifest(size), payload("probe", size))
    (found,) = [f for f in store.state_files() if f.key == key("probe")]
    store.delete(key("probe"))
    return found.size


# ------------------------------------------------------------------ the order
def test_lru_orders_by_last_use_and_value_by_recency_weighted_hits() -> None:
    lru, value = Uses("lru"), Uses("value", half_life_s=100.0)
    for uses in (lru, value):
        for _ in range(3):
            uses.hit("a", now=0.0)
        uses.hit("b", now=50.0)
    entries = [("a", 0.0), ("b", 50.0), ("c", 10.0)]
    assert lru.order(entries, now=60.0) == ["a", "c", "b"]
    assert value.order(entries, now=60.0) == ["c", "b", "a"]  # never hit here, one hit, three hits
    # a hit weighs half as much after each half-life: a's three hits at 0 now weigh less than b's one at 500
    value.hit("b", now=500.0)
    assert value.score("a", now=500.0) == pytest.approx(3 * 2 ** -5)
    assert value.order([("a", 0.0), ("b", 500.0)], now=500.0) == ["a", "b"]


def fill_use_and_overflow(store, size: int) -> list[str]:
    """Three states filling `store`, used so that the least recently used (a, read before b and c)
    and the least used (b, one read, older than c's) differ, then a fourth: the names still held."""
    for name in "abc":
        store.put(key(name), manifest(size), payload(name, size))
    for _ in range(3):
        store.read(key("a"))
    store.read(key("b"))
    store.read(key("c"))
    store.put(key("d"), manifest(size), payload("d", size))
    return sorted(n for n in "abcd" if key(n) in store)


GONE = {"lru": "a", "value": "b"}


@pytest.mark.parametrize("eviction", ["lru", "value"])
def test_a_full_memory_tier_drops_by_its_order(eviction: str) -> None:
    size = 1000
    store = MemoryStore(max_bytes=3 * (size + len(manifest(size))), eviction=eviction)  # type: ignore[arg-type]
    assert fill_use_and_overflow(store, size) == sorted(set("abcd") - {GONE[eviction]})
    assert store.evictions == 1 and store.bytes_held <= store.max_bytes  # type: ignore[operator]


@pytest.mark.parametrize("eviction", ["lru", "value"])
def test_a_full_disk_tier_drops_by_its_order(tmp_path, eviction: str) -> None:
    size = 10_000
    probe = disk(tmp_path / "probe", 1 << 30)
    store = disk(tmp_path / "store", 3 * file_size(probe, size), eviction)
    assert fill_use_and_overflow(store, size) == sorted(set("abcd") - {GONE[eviction]})


def test_another_process_reads_count_as_uses_on_disk(tmp_path) -> None:
    """Recency lives in the files (their modification time): a second store object on the same folder,
    as a second process would have, sees the first one's reads."""
    size = 10_000
    probe = disk(tmp_path / "probe", 1 << 30)
    cap = 3 * file_size(probe, size)
    writer, reader = disk(tmp_path / "store", cap), disk(tmp_path / "store", cap)
    for name in "abc":
        writer.put(key(name), manifest(size), payload(name, size))
    reader.read(key("a"))
    writer.put(key("d"), manifest(size), payload("d", size))
    assert key("a") in writer and key("b") not in writer


def test_a_state_larger_than_the_cap_is_not_kept(tmp_path) -> None:
    store = disk(tmp_path, 8192)
    store.put(key("big"), manifest(100_000), payload("big", 100_000))
    assert key("big") not in store and store.state_files() == []


# ------------------------------------------------------------ the bound, under load
def test_a_capped_disk_tier_stays_within_one_state_of_its_cap_while_readers_read(tmp_path) -> None:
    """A 200 MiB tier under 1 GiB of deposits: sampled all along, its state files (and any write
    in progress) never pass the cap by more than one state, and readers running during eviction get
    the whole state they asked for or a miss, never an error or another state's bytes."""
    size, cap = 16 << 20, 200 << 20
    store = disk(tmp_path, cap)
    names = [f"doc-{i}" for i in range(64)]  # 64 x 16 MiB = 1 GiB
    expected = {key(n): hashlib.sha256(payload(n, size)).hexdigest() for n in names}
    done, errors, seen, peak = threading.Event(), [], {"whole": 0, "miss": 0}, [0]
    folder = tmp_path / "states"

    def sample() -> None:
        # The walk holds the eviction lock: a walk over the folders while states are dropped in one
        # and written in another would add up files that never were on disk together.
        while not done.is_set():
            total = 0
            with open(tmp_path / ".evict.lock", "a+b") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                for root, _, files in os.walk(folder):
                    for f in files:
                        try:
                            total += os.lstat(os.path.join(root, f)).st_size
                        except FileNotFoundError:
                            pass
            peak[0] = max(peak[0], total)

    def read() -> None:
        reader = disk(tmp_path, cap)
        i = 0
        while not done.is_set():
            k = key(names[i % len(names)])
            i += 7
            try:
                got = reader.read(k)
            except Exception as e:  # noqa: BLE001 - any error is the failure this test looks for
                errors.append(repr(e))
                continue
            if got is None:
                seen["miss"] += 1
            elif hashlib.sha256(bytes(got.payload)).hexdigest() == expected[k]:
                seen["whole"] += 1
            else:
                errors.append(f"{k[:12]}: another state's bytes")

    threads = [threading.Thread(target=sample)] + [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for n in names:
            store.put(key(n), manifest(size), payload(n, size))
    finally:
        done.set()
        for t in threads:
            t.join()
    one_state = max(f.size for f in store.state_files())
    assert errors == []
    assert peak[0] <= cap + one_state, f"peak {peak[0] / 2**20:.1f} MiB over a {cap >> 20} MiB cap"
    assert sum(f.size for f in store.state_files()) <= cap
    assert store.evictions >= 64 - cap // one_state
    assert seen["whole"] > 0 and seen["miss"] > 0  # the readers ran while states came and went


# ---------------------------------------------------------------------- gc
def test_gc_drops_unused_states_then_the_first_to_go_until_the_size_fits(tmp_path) -> None:
    store = DiskStore(tmp_path)  # uncapped: gc bounds it on request
    engine = KVEngine(tiny("llama"), store)
    a, b, c, d = (engine.deposit(doc) for doc in (DOC_A, DOC_B, DOC_C, DOC_A + " " + DOC_B))
    files = {f.key: f for f in store.state_files()}
    old = files[a.key].last_used - 3600
    os.utime(files[a.key].path, (old, old))
    os.utime(files[b.key].path, (old + 3000, old + 3000))  # used 10 minutes ago: not stale, but first in line

    dry = collect_garbage(store, dry_run=True, unused_for_s=1800)
    assert dry.evicted_states == [a.key] and a.key in store and dry.damaged_states == []
    fit = files[c.key].size + files[d.key].size
    report = collect_garbage(store, unused_for_s=1800, max_bytes=fit)
    assert report.evicted_states == [a.key, b.key]
    assert report.evicted_bytes == files[a.key].size + files[b.key].size
    assert {f.key for f in store.state_files()} == {c.key, d.key}


# ------------------------------------------------------------------ the URL
def test_tier_urls_take_a_cap_and_an_order(tmp_path) -> None:
    capped = open_store(f"disk://{tmp_path}?max_gib=0.5&evict=value")
    assert isinstance(capped, DiskStore) and capped.max_bytes == 1 << 29 and capped.uses.eviction == "value"
    assert open_store(capped.url).url == capped.url
    memory = open_store("memory://?max_mib=2&evict=value&half_life_s=60")
    assert isinstance(memory, MemoryStore) and memory.max_bytes == 2 << 20 and memory.uses.half_life_s == 60
    for bad in ("max_gib=abc", "max_gib=0", "max_gib=nan", "evict=mru", "half_life_s=-1", "cap=3"):
        with pytest.raises(StoreError):
            open_store(f"disk://{tmp_path}?{bad}")


@given(st.dictionaries(st.sampled_from(["max_gib", "evict", "half_life_s"]), st.text(max_size=12)))
def test_capacity_parameters_parse_or_raise_a_store_error(params: dict[str, str]) -> None:
    try:
        max_bytes, eviction, half_life_s = capacity_params(params, size_name="max_gib")
    except StoreError:
        return
    assert (max_bytes is None or max_bytes >= 1) and eviction in ("lru", "value") and half_life_s > 0


def test_kvrag_gc_bounds_a_disk_tier_on_request(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from kvrag.cli import app

    store = DiskStore(tmp_path)
    engine = KVEngine(tiny("llama"), store)
    kept, dropped = engine.deposit(DOC_A), engine.deposit(DOC_B)
    files = {f.key: f for f in store.state_files()}
    os.utime(files[dropped.key].path, (0, files[kept.key].last_used - 7200))
    result = CliRunner().invoke(app, ["gc", "--store", f"disk://{tmp_path}", "--older-than", "1h", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["evicted_states"] == [dropped.key] and kept.key in store
    result = CliRunner().invoke(app, ["gc", "--store", f"disk://{tmp_path}", "--older-than", "3x"])
    assert result.exit_code == 2 and "a duration is a number" in result.output
