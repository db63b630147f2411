"""`kvrag ingest`, `kvrag ls`, `kvrag inspect` and `kvrag gc`: filling a store with a corpus, what
it holds, one state's manifest in each tier, and housekeeping."""

from __future__ import annotations

import json
import time
from typing import Optional

import typer
from rich.table import Table

from kvrag.cli.common import (
    ATTN,
    DEADLINE,
    DTYPE,
    JSON,
    LAYOUT,
    MODEL,
    NAMESPACE,
    SIGNING_KEY_FILE,
    STORE,
    THREADS,
    Attn,
    Dtype,
    Layout,
    Trust,
    duration_seconds,
    engine_for,
    err,
    fail,
    out,
    progress,
    signing_key,
)
from kvrag.errors import KVRagError

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    app.command(epilog=INGEST_EXAMPLES)(ingest)
    app.command("ls", epilog="Example: kvrag ls --store redis://127.0.0.1:6379/0,disk://./states --json")(ls_states)
    app.command(epilog="Example: kvrag inspect 3f2a...e9 --store disk://./states --json   (or: kvrag inspect gates)")(inspect)
    app.command(epilog=GC_EXAMPLES)(gc)


def ls_states(
    store: Optional[str] = STORE,
    namespace: Optional[str] = NAMESPACE,
    signing_key_file: Optional[str] = SIGNING_KEY_FILE,
    as_json: bool = JSON,
) -> None:
    """List the states in a store, tier by tier, and the blend gates' verdicts."""
    from kvrag.apps.maintenance import list_gates, list_states
    from kvrag.stores import open_store

    try:
        opened, key = open_store(store), signing_key(signing_key_file)
        infos, gates = list(list_states(opened, key, namespace)), list_gates(opened, key, namespace)
    except KVRagError as e:
        fail(e)
    if as_json:
        print(json.dumps([i.model_dump() for i in infos], indent=2))
        return
    table = Table(title=f"{len(infos)} states")
    for column in ("key", "tier", "model", "start", "tokens", "size", "parent", "signature"):
        table.add_column(column)
    for i in infos:
        size = f"{i.payload_bytes / 2**20:.1f} MiB" if i.payload_bytes is not None else ""
        table.add_row(i.key[:16], i.tier, i.model or f"[red]{i.error}[/]", str(i.start or 0), str(i.tokens or ""),
                      size, (i.parent_key or "")[:12], i.signature or "")
    out.print(table)
    if gates:
        gate_table = Table(title=f"{len(gates)} blend gates (signed with your key)")
        for column in ("model", "fingerprint", "ratio", "mean KL", "argmax agreement", "samples", "verdict", "at"):
            gate_table.add_column(column)
        for g in gates:
            gate_table.add_row(g.model, g.model_fingerprint[:12], f"{g.ratio:.2f}" + ("" if g.rerotate else " unrotated"),
                               f"{g.kl_mean:.3g}", f"{g.argmax_agreement:.0%}", str(g.samples),
                               "allowed" if g.passed else "refused", g.at[:19])
        out.print(gate_table)


def inspect(
    key: str = typer.Argument(..., help="a state key (64 hex characters), or 'gates' for the blend gates' verdicts"),
    store: Optional[str] = STORE,
    namespace: Optional[str] = NAMESPACE,
    signing_key_file: Optional[str] = SIGNING_KEY_FILE,
    as_json: bool = JSON,
) -> None:
    """Show a state's manifest in each tier and check its payload there (or the blend gates)."""
    from kvrag.apps.maintenance import inspect_state, list_gates
    from kvrag.stores import open_store

    try:
        signer = signing_key(signing_key_file)
        if key == "gates":
            print(json.dumps([g.model_dump() for g in list_gates(open_store(store), signer, namespace)], indent=2))
            return
        found = inspect_state(open_store(store), key, signer, namespace)
    except KVRagError as e:
        fail(e)
    if as_json:
        print(json.dumps(found, indent=2))
        return
    for tier, entry in found.items():
        manifest = entry.get("manifest", {})
        out.print(f"[bold]{tier}[/]: payload {entry['payload']}")
        if manifest:
            fp = manifest["model_fingerprint"]
            out.print(f"  model {fp['name']} ({fp['digest'][:16]}), {manifest['token_count']} tokens at "
                      f"{manifest['start']}, parent {manifest['parent_key'] or '-'}, "
                      f"{manifest['payload_bytes'] / 2**20:.1f} MiB, {len(manifest['layers'])} layers, "
                      f"layout {manifest.get('prompt_layout') or 'unnamed'}, "
                      f"signature: {entry['signature']} (checked with your key)")


def gc(
    store: Optional[str] = STORE,
    other_models: bool = typer.Option(False, "--other-models", help="also drop states of other model fingerprints"),
    model: str = MODEL,
    dtype: Dtype = DTYPE,
    attn: Attn = ATTN,
    dry_run: bool = typer.Option(False, "--dry-run", help="report, delete nothing"),
    grace: float = typer.Option(600.0, "--grace", min=0, help="seconds: temporary files and orphan frames younger "
                                "than this may belong to a write in progress and are kept"),
    max_gib: Optional[float] = typer.Option(None, "--max-gib", min=0, help="drop states from each disk tier, in its "
                                            "eviction order, until its state files hold at most this many GiB"),
    older_than: Optional[str] = typer.Option(None, "--older-than", help="drop states of disk tiers not read or written "
                                             "for this long: 90s, 30m, 12h, 7d"),
    namespace: Optional[str] = NAMESPACE,
    signing_key_file: Optional[str] = SIGNING_KEY_FILE,
    deadline: Optional[float] = DEADLINE,
    threads: Optional[int] = THREADS,
    as_json: bool = JSON,
) -> None:
    """Drop orphan frames, stray temporary files and damaged states (and, on request, other models'
    states, states unused for a while, and the least valued beyond a size)."""
    from kvrag.apps.maintenance import collect_garbage
    from kvrag.stores import open_store

    try:
        keep = None
        unused_for_s = duration_seconds(older_than) if older_than is not None else None
        if other_models:
            keep = engine_for(model, store, dtype, attn, None, Trust(namespace, signing_key_file, deadline, threads)).fingerprint
        report = collect_garbage(open_store(store), keep_fingerprint=keep, dry_run=dry_run, grace_s=grace,
                                 max_bytes=None if max_gib is None else int(max_gib * 2**30), unused_for_s=unused_for_s)
    except KVRagError as e:
        fail(e)
    if as_json:
        print(report.model_dump_json(indent=2))
        return
    verb = "would drop" if dry_run else "dropped"
    out.print(f"{verb}: {report.orphan_frames} orphan frames, {report.stray_files} stray files, "
              f"{len(report.damaged_states)} damaged states, {len(report.other_model_states)} states of other models, "
              f"{len(report.evicted_states)} states evicted ({report.evicted_bytes / 2**20:.1f} MiB)")


GC_EXAMPLES = """Examples:

  kvrag gc --store redis://127.0.0.1:6379/0 --other-models --model smollm2-135m --dry-run

  kvrag gc --store disk://./states --max-gib 50 --older-than 30d"""


INGEST_EXAMPLES = """Examples:

  kvrag ingest ./corpus --store disk://./states                (a folder of .txt and .md files)

  kvrag ingest docs.jsonl --store redis+cluster://10.0.0.5:7000 --shard 0/4    (and 1/4, 2/4, 3/4 elsewhere)"""


def ingest(
    path: str = typer.Argument(..., help='a folder of .txt/.md files, or a JSONL file of {"id", "text"} lines'),
    model: str = MODEL,
    store: Optional[str] = STORE,
    dtype: Dtype = DTYPE,
    attn: Attn = ATTN,
    layout: Optional[Layout] = LAYOUT,
    shard: str = typer.Option("0/1", "--shard", help="i/N: only the documents whose id hashes to i of N"),
    namespace: Optional[str] = NAMESPACE,
    signing_key_file: Optional[str] = SIGNING_KEY_FILE,
    deadline: Optional[float] = DEADLINE,
    threads: Optional[int] = THREADS,
    as_json: bool = JSON,
) -> None:
    """Deposit every document of a corpus as its own verified state; what the store holds already
    is skipped, so a stopped ingest resumes. Exits 1 if a document could not be deposited."""
    from rich.progress import TextColumn

    from kvrag.apps.ingest import Shard, read_corpus
    from kvrag.apps.ingest import ingest as run_ingest

    try:
        part = Shard.parse(shard)
        documents = read_corpus(path)
        engine = engine_for(model, store, dtype, attn, layout, Trust(namespace, signing_key_file, deadline, threads))
        with progress(as_json) as bar:
            bar.columns = (*bar.columns, TextColumn("{task.fields[rate]}"))
            task = bar.add_task(f"ingest {part}", total=sum(part.takes(d.id) for d in documents), rate="")
            tokens, began = [0], time.perf_counter()

            def advance(_document: object, count: int) -> None:
                tokens[0] += count
                rate = tokens[0] / max(time.perf_counter() - began, 1e-9)
                bar.update(task, advance=1, rate=f"{rate:,.0f} tokens/s")

            summary = run_ingest(engine, documents, shard=part, progress=advance)
    except KVRagError as e:
        fail(e)
    if as_json:
        print(summary.model_dump_json(indent=2))
    else:
        out.print(f"shard {summary.shard}: {summary.documents} documents, {summary.deposited} deposited "
                  f"({summary.tokens:,} tokens, {summary.bytes / 2**20:,.1f} MiB), {summary.skipped} already stored, "
                  f"{len(summary.failed)} failed, in {summary.seconds:,.1f} s")
        for failure in summary.failed:
            err.print(f"failed: {failure.id}: {failure.error}", soft_wrap=True, highlight=False)
    if summary.failed:
        raise typer.Exit(1)
