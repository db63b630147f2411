"""The Redis tier against real throwaway servers: faults end in the right answer, and say how."""

from __future__ import annotations

import json
import logging
import time

import pytest
import redis as redis_py
from typer.testing import CliRunner

from kvrag import IntegrityError, KVEngine, MemoryStore, StoreError, open_store
from kvrag.artifacts.format import parse_manifest
from kvrag.cli import app
from kvrag.errors import StoreUnavailableError
from kvrag.stores import DiskStore, RedisStore, TieredStore
from kvrag.stores.redis.frames import parse_frame_table
from kvrag.testing import RedisServer, free_port
from kvrag.trust.signing import resolve_signing_key, sign_manifest

from ..conftest import DOC_A, DOC_B, QUESTION, tiny

runner = CliRunner()

FRAME = "frame_mib=0.01"  # ~10 KiB frames, so tiny-model states span many frames


@pytest.fixture(scope="module")
def reference():
    engine = KVEngine(tiny("llama"), MemoryStore())
    return engine.generate(QUESTION, states=[DOC_A], max_new_tokens=6, graft=False)


def _redis_engine(server, *extra_tiers, **kwargs):
    urls = [f"{server.url}?{FRAME}", *extra_tiers]
    return KVEngine(tiny("llama"), ",".join(urls), **kwargs)


def _raw(server) -> redis_py.Redis:
    return redis_py.Redis(port=server.port)


def _frames(server, key):
    return sorted(k.decode() for k in _raw(server).keys(f"kvrag:{{{key}}}:f:*"))


def _same_answer(generation, reference):
    assert generation.receipt.first_token_logits_sha256 == reference.receipt.first_token_logits_sha256
    assert generation.tokens == reference.tokens


def test_round_trip_through_redis_is_exact(redis_server, reference):
    engine = _redis_engine(redis_server)
    ref = engine.deposit(DOC_A)
    assert len(_frames(redis_server, ref.key)) > 3
    generation = engine.generate(QUESTION, states=[ref], max_new_tokens=6)
    assert generation.receipt.mode == "exact-graft" and generation.receipt.states[0].tier.startswith("redis://")
    _same_answer(generation, reference)


def _flip(server, key):
    name = _frames(server, key)[1]
    data = bytearray(_raw(server).get(name))
    data[len(data) // 2] ^= 0x01
    _raw(server).set(name, bytes(data))


def _delete_frame(server, key):
    _raw(server).delete(_frames(server, key)[2])


def _truncate(server, key):
    name = _frames(server, key)[0]
    _raw(server).set(name, _raw(server).get(name)[:-7])


def _foreign_manifest(server, key):
    """Another model's manifest, signed with our key (this user's): the fingerprint refuses it."""
    record = json.loads(_raw(server).get(f"kvrag:{{{key}}}:m"))
    manifest = parse_manifest(record["manifest"])
    other = manifest.model_fingerprint.model_copy(update={"name": "someone-else"})
    record["manifest"] = sign_manifest(manifest.model_copy(update={"model_fingerprint": other}),
                                       resolve_signing_key()).model_dump_json()
    _raw(server).set(f"kvrag:{{{key}}}:m", json.dumps(record))


FAULTS = {
    "flipped byte in a frame": (_flip, "integrity"),
    "deleted frame": (_delete_frame, "missing"),
    "truncated frame": (_truncate, "integrity"),
    "manifest from another model": (_foreign_manifest, "foreign"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_damaged_redis_copy_is_read_from_the_next_tier(fault, stream, redis_server, tmp_path, reference):
    damage, reason = FAULTS[fault]
    engine = _redis_engine(redis_server, f"disk://{tmp_path}", stream_grafts=stream)
    ref = engine.deposit(DOC_A)
    damage(redis_server, ref.key)
    generation = engine.generate(QUESTION, states=[ref], max_new_tokens=6)
    use = generation.receipt.states[0]
    assert generation.receipt.mode == "exact-graft" and use.tier == f"disk://{tmp_path}", generation.receipt.states
    assert reason in use.detail and use.detail.startswith("redis://")
    _same_answer(generation, reference)
    # The verified disk copy was promoted back into Redis: the next ask grafts from the hot tier.
    again = engine.generate(QUESTION, states=[ref], max_new_tokens=6)
    assert again.receipt.states[0].tier.startswith("redis://") and again.receipt.states[0].detail is None


@pytest.mark.parametrize("wire", ["direct", "client"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_frames_fetched_over_several_connections_are_checked_alike(fault, wire, redis_server, reference):
    damage, reason = FAULTS[fault]
    engine = KVEngine(tiny("llama"), f"{redis_server.url}?{FRAME}&connections=3&wire={wire}")
    ref = engine.deposit(DOC_A)
    _same_answer(engine.generate(QUESTION, states=[ref], max_new_tokens=6, memo=False), reference)
    damage(redis_server, ref.key)
    generation = engine.generate(QUESTION, states=[ref], max_new_tokens=6, memo=False)
    assert generation.receipt.mode == "text-prefill" and generation.receipt.states[0].reason == reason
    _same_answer(generation, reference)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_damaged_state_in_the_only_tier_is_re_read_as_text(fault, redis_server, reference):
    damage, reason = FAULTS[fault]
    engine = _redis_engine(redis_server)
    ref = engine.deposit(DOC_A)
    damage(redis_server, ref.key)
    generation = engine.generate(QUESTION, states=[ref], max_new_tokens=6)
    assert generation.receipt.mode == "text-prefill" and generation.receipt.states[0].reason == reason
    _same_answer(generation, reference)


def test_a_tampered_manifest_is_refused_with_signing_on(redis_server, tmp_path, reference, caplog):
    engine = _redis_engine(redis_server, signing_key="s3cret")
    ref = engine.deposit(DOC_A)
    record = json.loads(_raw(redis_server).get(f"kvrag:{{{ref.key}}}:m"))
    manifest = json.loads(record["manifest"])
    assert manifest["signature"]
    manifest["deposit"]["compute_ms"] = 1.0  # any change, however harmless it looks
    record["manifest"] = json.dumps(manifest)
    _raw(redis_server).set(f"kvrag:{{{ref.key}}}:m", json.dumps(record))
    with caplog.at_level(logging.WARNING, logger="kvrag.signing"):
        generation = engine.generate(QUESTION, states=[ref], max_new_tokens=6)
    assert generation.receipt.mode == "text-prefill" and generation.receipt.states[0].reason == "signature"
    assert "signature does not match" in caplog.text
    _same_answer(generation, reference)


def test_unsigned_and_wrongly_signed_states_are_refused(redis_server, reference, monkeypatch):
    monkeypatch.setenv("KVRAG_SIGNING_KEY", "our-key")
    ours = _redis_engine(redis_server)
    ref = ours.deposit(DOC_A)
    genuine = ours.store.read(ref.key)
    # Someone without our key writes over our state's key (which SCAN shows them): their own
    # manifest for the same text, re-keyed to ours, once signed with their key and once unsigned.
    theirs = _redis_engine(redis_server, signing_key="their-key")
    manifest = parse_manifest(theirs.store.read(theirs.deposit(DOC_A).key).manifest).model_copy(update={"key": ref.key})
    for forged in (sign_manifest(manifest, b"their-key"), manifest.model_copy(update={"signature": None})):
        ours.store.put(ref.key, forged.to_json_bytes(), genuine.payload)
        refused = ours.generate(QUESTION, states=[ref], max_new_tokens=6)
        assert refused.receipt.mode == "text-prefill" and refused.receipt.states[0].reason == "signature"
        _same_answer(refused, reference)
    # Their ref, handed to us, is of another scope: never grafted, re-read as text.
    foreign = ours.generate(QUESTION, states=[theirs.ref(DOC_A)], max_new_tokens=1).receipt.states[0]
    assert foreign.source == "text" and foreign.reason == "foreign"
    ours.store.put(ref.key, genuine.manifest, genuine.payload)
    assert ours.generate(QUESTION, states=[ref], max_new_tokens=1).receipt.mode == "exact-graft"


class KillingRedisStore(RedisStore):
    """A real Redis tier whose server is killed after the frame table is read, before the frames."""

    def __init__(self, inner: RedisStore, server: RedisServer):
        super().__init__(inner._client_factory, url=inner.url, frame_bytes=inner.frame_bytes)
        self.server = server

    def read(self, key, check=None):
        def kill_after_the_record(manifest):
            self.server.stop(kill=True)
            return check(manifest) if check else None

        return super().read(key, kill_after_the_record)


def test_redis_killed_in_the_middle_of_a_read(redis_server, tmp_path, reference):
    writer = _redis_engine(redis_server, f"disk://{tmp_path}")
    ref = writer.deposit(DOC_A)
    tiers = TieredStore([KillingRedisStore(writer.tiers[0], redis_server), DiskStore(tmp_path)])
    engine = KVEngine(tiny("llama"), tiers)
    generation = engine.generate(QUESTION, states=[ref], max_new_tokens=6)
    use = generation.receipt.states[0]
    assert generation.receipt.mode == "exact-graft" and use.tier == f"disk://{tmp_path}"
    assert "unavailable" in use.detail
    _same_answer(generation, reference)
    # Redis alone, killed mid-read: the text answers.
    only = KVEngine(tiny("llama"), KillingRedisStore(writer.tiers[0], redis_server))
    assert only.generate(QUESTION, states=[ref], max_new_tokens=6).receipt.states[0].reason == "unavailable"


def test_redis_down_from_the_start(tmp_path, reference):
    down = f"redis://127.0.0.1:{free_port()}/0"
    engine = KVEngine(tiny("llama"), f"{down},disk://{tmp_path}")
    ref = engine.deposit(DOC_A)  # written to the disk tier; Redis is skipped with a warning
    generation = engine.generate(QUESTION, states=[ref], max_new_tokens=6)
    assert generation.receipt.mode == "exact-graft" and generation.receipt.states[0].tier == f"disk://{tmp_path}"
    assert "unavailable" in generation.receipt.states[0].detail
    _same_answer(generation, reference)
    alone = KVEngine(tiny("llama"), down)
    with pytest.raises(StoreError):
        alone.deposit(DOC_A)
    text = alone.generate(QUESTION, states=[DOC_A], max_new_tokens=6)
    assert text.receipt.mode == "text-prefill" and text.receipt.states[0].reason == "unavailable"
    _same_answer(text, reference)


def test_a_colder_hit_is_promoted_and_hot_only_writes(redis_server, tmp_path):
    disk = KVEngine(tiny("llama"), f"disk://{tmp_path}")
    ref = disk.deposit(DOC_A)
    tiered = _redis_engine(redis_server, f"disk://{tmp_path}")
    assert tiered.tiers[0].read_manifest(ref.key) is None
    assert tiered.generate(QUESTION, states=[ref], max_new_tokens=1).receipt.states[0].tier == f"disk://{tmp_path}"
    assert tiered.tiers[0].read_manifest(ref.key) is not None

    hot_only = KVEngine(tiny("llama"), open_store(f"{redis_server.url}?{FRAME},disk://{tmp_path}/hot", write="hot"))
    other = hot_only.deposit(DOC_B)
    assert hot_only.tiers[0].read_manifest(other.key) is not None
    assert hot_only.tiers[1].read_manifest(other.key) is None


def test_ttl_expires_states(redis_server, reference):
    engine = KVEngine(tiny("llama"), f"{redis_server.url}?{FRAME}&ttl=1")
    ref = engine.deposit(DOC_A)
    assert 0 < _raw(redis_server).ttl(f"kvrag:{{{ref.key}}}:m") <= 1
    assert all(0 < _raw(redis_server).ttl(name) <= 1 for name in _frames(redis_server, ref.key))
    time.sleep(1.3)
    generation = engine.generate(QUESTION, states=[ref], max_new_tokens=6)
    assert generation.receipt.mode == "text-prefill" and generation.receipt.states[0].reason == "missing"
    _same_answer(generation, reference)


def test_eviction_under_maxmemory_grafts_a_state_whole_or_not_at_all(tmp_path):
    """Redis evicts frames and records at random: a state with any part gone is a miss, read as text
    in its own segment, while the rest of its chain still grafts (a partial graft, exact)."""
    server = RedisServer(tmp_path / "small", extra=("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-random")).start()
    try:
        engine = KVEngine(tiny("llama"), f"{server.url}?frame_mib=0.005")
        texts = [f"{DOC_A} Record number {i}. {DOC_B}" * 3 for i in range(12)]
        chains = [texts[i : i + 2] for i in range(0, len(texts), 2)]
        for chain in chains:
            try:
                engine.deposit_chain(chain)
            except StoreError:  # Redis may refuse a write outright when it cannot evict enough
                pass
        assert _raw(server).info("stats")["evicted_keys"] > 0
        uses = []
        for chain in chains:
            graft = engine.generate(QUESTION, states=chain, max_new_tokens=2)
            text = engine.generate(QUESTION, states=chain, max_new_tokens=2, graft=False)
            assert graft.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256
            for use, segment in zip(graft.receipt.states, engine.plan(chain), strict=True):
                assert (use.start, use.end) == (segment.start, segment.end)  # whole segments only
                uses.append(use)
        assert {u.reason for u in uses if u.source == "text"} == {"missing"}  # some were evicted, each a miss
    finally:
        server.stop()


def test_store_urls_take_credentials_and_options(monkeypatch):
    store = open_store("redis://alice:pw@127.0.0.1:1/3?ttl=60&frame_mib=2&prefix=team")
    assert isinstance(store, RedisStore) and store.ttl == 60 and store.frame_bytes == 2 << 20 and store.prefix == "team"
    tiers = open_store("redis+cluster://127.0.0.1:7000,127.0.0.1:7001,disk:///tmp/x")
    assert isinstance(tiers, TieredStore) and [type(t).__name__ for t in tiers.tiers] == ["RedisStore", "DiskStore"]
    assert tiers.tiers[0].cluster
    for bad in ("redis://h:1/0?ttl=abc", "redis://h:1/0?ttl=0", "redis+cluster://nohostport"):
        with pytest.raises(StoreError):
            open_store(bad)


def test_frame_records_are_checked_before_allocating(redis_server):
    engine = _redis_engine(redis_server)
    ref = engine.deposit(DOC_A)
    name = f"kvrag:{{{ref.key}}}:m"
    record = json.loads(_raw(redis_server).get(name))
    record["payload_bytes"] = 1 << 40
    _raw(redis_server).set(name, json.dumps(record))
    with pytest.raises(IntegrityError, match="frame table is malformed"):
        parse_frame_table(_raw(redis_server).get(name))
    assert engine.generate(QUESTION, states=[ref], max_new_tokens=1).receipt.states[0].reason == "integrity"


@pytest.mark.parametrize("kind", ["memory", "disk", "redis", "tiered"])
def test_blobs_get_set_delete_list_and_expire(kind, tmp_path, redis_server):
    import time

    urls = {"memory": "memory://", "disk": f"disk://{tmp_path}", "redis": redis_server.url,
            "tiered": f"{redis_server.url},disk://{tmp_path}"}
    store = open_store(urls[kind])
    name, other = "memo/" + "a" * 64, "memo/" + "b" * 64
    assert store.get_blob(name) is None
    store.put_blob(name, b"one")
    store.put_blob(other, b"two", ttl=1)
    assert store.get_blob(name) == b"one" and sorted(store.blob_names("memo")) == sorted([name, other])
    assert list(store.blob_names("cache")) == []
    time.sleep(1.2)
    assert store.get_blob(other) is None and list(store.blob_names("memo")) == [name]
    store.delete_blob(name)
    assert store.get_blob(name) is None
    with pytest.raises(StoreError):
        store.get_blob("../../etc/passwd")


def test_ls_inspect_and_gc(redis_server, tmp_path):
    import redis as redis_py

    from kvrag import KVEngine
    from kvrag.stores.disk import DiskStore

    from ..conftest import DOC_B, tiny

    store = f"{redis_server.url}?frame_mib=0.01,disk://{tmp_path}"
    ours = KVEngine(tiny("llama"), store).deposit(DOC_A)
    theirs = KVEngine(tiny("qwen2"), store).deposit(DOC_B)
    listed = json.loads(runner.invoke(app, ["ls", "--store", store, "--json"]).stdout)
    assert {(i["key"], i["tier"].split(":")[0]) for i in listed} == {
        (ours.key, "redis"), (ours.key, "disk"), (theirs.key, "redis"), (theirs.key, "disk")}
    table = runner.invoke(app, ["ls", "--store", store])
    assert table.exit_code == 0 and "4 states" in table.stdout

    inspected = json.loads(runner.invoke(app, ["inspect", ours.key, "--store", store, "--json"]).stdout)
    assert len(inspected) == 2 and all(e["payload"].startswith("ok") for e in inspected.values())
    missing = runner.invoke(app, ["inspect", "0" * 64, "--store", store])
    assert missing.exit_code == 2 and "no state" in missing.output

    # Leave garbage: an orphan frame in Redis and a stray temporary file on disk.
    raw = redis_py.Redis(port=redis_server.port)
    raw.set(f"kvrag:{{{ours.key}}}:f:deadbeefdeadbeef:0", b"x")
    (tmp_path / "states" / ours.key[:2] / ".interrupted.tmp").write_bytes(b"partial")
    dry = json.loads(runner.invoke(app, ["gc", "--store", store, "--dry-run", "--grace", "0", "--json"]).stdout)
    assert dry["orphan_frames"] == 1 and dry["stray_files"] == 1
    done = runner.invoke(app, ["gc", "--store", store, "--other-models", "--model", "tiny-random-llama", "--grace", "0", "--json"])
    report = json.loads(done.stdout)
    assert report["orphan_frames"] == 1 and report["other_model_states"] == [theirs.key, theirs.key]
    assert raw.get(f"kvrag:{{{ours.key}}}:f:deadbeefdeadbeef:0") is None
    assert list(DiskStore(tmp_path).keys()) == [ours.key]
    assert KVEngine(tiny("llama"), store).generate("Who?", states=[ours], max_new_tokens=1).receipt.mode == "exact-graft"


def test_direct_frame_reads_authenticate_and_select_the_database(tmp_path, reference):
    from kvrag.testing import RedisServer

    server = RedisServer(tmp_path / "auth", password="s3cret").start()
    try:
        engine = KVEngine(tiny("llama"), f"redis://:s3cret@127.0.0.1:{server.port}/2?{FRAME}")
        ref = engine.deposit(DOC_A)
        generation = engine.generate(QUESTION, states=[ref], max_new_tokens=6, memo=False)
        assert generation.receipt.mode == "exact-graft"
        _same_answer(generation, reference)
        wrong = KVEngine(tiny("llama"), f"redis://:wrong@127.0.0.1:{server.port}/2?{FRAME}")
        refused = wrong.generate(QUESTION, states=[DOC_A], max_new_tokens=6, memo=False)
        assert refused.receipt.mode == "text-prefill" and refused.receipt.states[0].reason == "unavailable"
    finally:
        server.stop()


def _put_raw(store: RedisStore, key: str, payload: bytes, chunk: int = 1 << 20) -> None:
    store.put(key, json.dumps({"payload_chunk_bytes": chunk}).encode(), payload)


def test_frames_are_written_over_the_direct_wire_byte_for_byte_and_a_refused_write_leaves_no_state(tmp_path):
    """Frames go out from where they lie over kvrag's own connection (with AUTH and SELECT); a
    server that refuses a frame (out of memory) is up: the write is a plain `StoreError`, the
    breaker stays closed, and no frame table is written, so readers see a miss, never half a state."""
    server = RedisServer(tmp_path / "oom", password="pw",
                         extra=("--maxmemory", "8mb", "--maxmemory-policy", "noeviction")).start()
    try:
        store = open_store(f"redis://:pw@127.0.0.1:{server.port}/3")
        assert store.frame_pool is not None
        small, large = bytes(range(256)) * 9000, bytes(range(255, -1, -1)) * 40000  # 2.3 MB in 3 frames, 10 MB
        _put_raw(store, "a" * 64, small)
        raw = redis_py.Redis(port=server.port, password="pw", db=3)
        table = parse_frame_table(raw.get(f"kvrag:{{{'a' * 64}}}:m"))
        assert b"".join(raw.get(f"kvrag:{{{'a' * 64}}}:f:{table.payload_id}:{i}") for i in range(3)) == small
        with pytest.raises(StoreError) as refused:
            _put_raw(store, "b" * 64, large)
        assert not isinstance(refused.value, StoreUnavailableError) and "OOM" in str(refused.value)
        assert not store.breaker.is_open and not store.holds("b" * 64) and store.holds("a" * 64)
        raw.delete(*raw.keys(f"kvrag:{{{'b' * 64}}}:f:*"))
        _put_raw(store, "c" * 64, small[:1000])  # the server still takes what fits
        assert store.holds("c" * 64)
    finally:
        server.stop()


def test_a_write_after_a_redis_restart_takes_a_fresh_connection(tmp_path):
    server = RedisServer(tmp_path / "restart").start()
    try:
        store = open_store(server.url)
        _put_raw(store, "a" * 64, b"x" * 3_000_000)
        server.stop()
        server.start()  # same port: the pooled connection is stale
        _put_raw(store, "b" * 64, b"y" * 3_000_000)
        assert store.holds("b" * 64) and not store.breaker.is_open
    finally:
        server.stop()
