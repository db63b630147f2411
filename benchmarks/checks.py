"""What each trust check costs: measured per call, in one process, on this machine.

For a state of smollm2-135m (float32) over a ~1,500-token document: the manifest's signature
checked on its stored bytes, the manifest parsed, the payload's per-read check (its keyed BLAKE3
tags, as every state now has; AES-256-GCM for a confidential one; the chunk SHA-256s of states
written before tags), a sealed record's MAC and an encrypted one's AEAD, a tenant key's derivation (once per engine), the thread check an engine makes per read, and
the constant-time API key lookup `kvrag serve` makes per request (over 100 keys). Medians of
--repeat runs; what matters is each check beside the others and beside a graft.

    python benchmarks/checks.py [--repeat 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvrag import KVEngine, MemoryStore, load_model
from kvrag.artifacts import chunk_digests, parse_manifest
from kvrag.artifacts.digests import open_payload
from kvrag.artifacts.payloads import chunking_of
from kvrag.data import long_document
from kvrag.server.app import ApiKey, ServeSettings
from kvrag.trust import derive_tenant_key
from kvrag.trust.confidential import encrypt_record, open_manifest, open_record
from kvrag.trust.signing import check_manifest_bytes, seal, unseal


def timed(fn, repeat: int) -> float:
    """The median seconds of `fn()` over `repeat` calls."""
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=1500)
    args = parser.parse_args()

    model = load_model("smollm2-135m")
    engine = KVEngine(model, MemoryStore())
    document = long_document(model.tokenizer, args.tokens)
    ref = engine.deposit(document)
    stored = engine.store.read(ref.key)
    raw, payload = stored.manifest, stored.payload
    chunking = chunking_of(parse_manifest(raw), engine.signing_key)
    private = KVEngine(model, MemoryStore(), confidential=True)
    private_ref = private.deposit(document)
    sealed = private.store.read(private_ref.key)
    sealed_layout = chunking_of(parse_manifest(open_manifest(sealed.manifest, private.signing_key, private_ref.key)),
                              private.signing_key)
    encrypted_record = encrypt_record(engine.signing_key, "memo/" + "0" * 64, b"x" * 2048)
    record = seal(engine.signing_key, "memo/" + "0" * 64, b"x" * 2048)
    settings = ServeSettings(api_keys=[ApiKey(key=f"key-{i:04d}-" + "k" * 24, tenant=f"t{i}") for i in range(100)])
    header = f"Bearer {settings.api_keys[-1].key}"
    graft = timed(lambda: engine.generate("Who built it?", states=[ref], max_new_tokens=1, memo=False), 5)

    rows = [
        ("manifest signature, on the stored bytes", f"{len(raw) / 1024:.0f} KiB", timed(
            lambda: check_manifest_bytes(raw, engine.signing_key), args.repeat)),
        ("manifest parsed and validated", f"{len(raw) / 1024:.0f} KiB", timed(lambda: parse_manifest(raw), args.repeat)),
        ("payload keyed BLAKE3 tags (2 threads; every state now)", f"{len(payload) / 2**20:.1f} MiB", timed(
            lambda: open_payload(payload, chunking), max(5, args.repeat // 20))),
        ("payload AES-256-GCM, checked and decrypted (2 threads; confidential)", f"{len(sealed.payload) / 2**20:.1f} MiB",
         timed(lambda: open_payload(sealed.payload, sealed_layout), max(5, args.repeat // 20))),
        ("payload chunk SHA-256 (2 threads; states written before tags)", f"{len(payload) / 2**20:.1f} MiB", timed(
            lambda: chunk_digests(payload), max(5, args.repeat // 20))),
        ("sealed record MAC (memo, cache, gate, prefix records)", "2 KiB", timed(
            lambda: unseal(engine.signing_key, "memo/" + "0" * 64, record), args.repeat)),
        ("encrypted record AEAD (a confidential engine's records)", "2 KiB", timed(
            lambda: open_record(engine.signing_key, "memo/" + "0" * 64, encrypted_record), args.repeat)),
        ("confidential manifest opened (AEAD)", f"{len(sealed.manifest) / 1024:.0f} KiB", timed(
            lambda: open_manifest(sealed.manifest, private.signing_key, private_ref.key), args.repeat)),
        ("tenant key derivation (HKDF, once per engine)", "", timed(
            lambda: derive_tenant_key(b"operator", "tenant-a"), args.repeat)),
        ("thread check (hardware fingerprint, per read)", "", timed(engine.identity.check_hardware, args.repeat)),
        ("API key lookup, constant time over 100 keys (per request)", "", timed(
            lambda: settings.tenant_of(header), args.repeat)),
    ]
    print(f"\nWhat each check costs, {model.name} float32, a {ref.token_count:,}-token state; a whole graft "
          f"+ first token here: {graft * 1e3:.0f} ms (median of 5)\n")
    print("| check | size | time | share of the graft |")
    print("|---|---:|---:|---:|")
    for name, size, seconds in rows:
        print(f"| {name} | {size} | {seconds * 1e6:,.0f} µs | {seconds / graft:.2%} |")


if __name__ == "__main__":
    main()
