"""`kvrag ls`, `kvrag inspect` and `kvrag gc`: what a store holds, one state's manifest in each
tier, and housekeeping."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.table import Table

from kvrag.cli.common import (
    ATTN,
    DEADLINE,
    DTYPE,
    JSON,
    MODEL,
    NAMESPACE,
    SIGNING_KEY_FILE,
    STORE,
    THREADS,
    Attn,
    Dtype,
    Trust,
    engine_for,
    fail,
    out,
)
from kvrag.errors import KVRagError

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    app.command("ls", epilog="Example: kvrag ls --store redis://127.0.0.1:6379/0,disk://./states --json")(ls_states)
    app.command(epilog="Example: kvrag inspect 3f2a...e9 --store disk://./states --json   (or: kvrag inspect gates)")(inspect)
    app.command(epilog="Example: kvrag gc --store redis://127.0.0.1:6379/0 --other-models --model smollm2-135m --dry-run")(gc)


def ls_states(
    store: Optional[str] = STORE,
    as_json: bool = JSON,
) -> None:
    """List the states in a store, tier by tier, and the blend gates' verdicts."""
    from kvrag.apps.maintenance import list_gates, list_states
    from kvrag.stores import open_store

    try:
        opened = open_store(store)
        infos, gates = list(list_states(opened)), list_gates(opened)
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
    as_json: bool = JSON,
) -> None:
    """Show a state's manifest in each tier and check its payload there (or the blend gates)."""
    from kvrag.apps.maintenance import inspect_state, list_gates
    from kvrag.stores import open_store

    try:
        if key == "gates":
            print(json.dumps([g.model_dump() for g in list_gates(open_store(store))], indent=2))
            return
        found = inspect_state(open_store(store), key)
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
    namespace: Optional[str] = NAMESPACE,
    signing_key_file: Optional[str] = SIGNING_KEY_FILE,
    deadline: Optional[float] = DEADLINE,
    threads: Optional[int] = THREADS,
    as_json: bool = JSON,
) -> None:
    """Drop orphan frames, stray temporary files and damaged states (and other models' states on request)."""
    from kvrag.apps.maintenance import collect_garbage
    from kvrag.stores import open_store

    try:
        keep = None
        if other_models:
            keep = engine_for(model, store, dtype, attn, None, Trust(namespace, signing_key_file, deadline, threads)).fingerprint
        report = collect_garbage(open_store(store), keep_fingerprint=keep, dry_run=dry_run, grace_s=grace)
    except KVRagError as e:
        fail(e)
    if as_json:
        print(report.model_dump_json(indent=2))
        return
    verb = "would drop" if dry_run else "dropped"
    out.print(f"{verb}: {report.orphan_frames} orphan frames, {report.stray_files} stray files, "
              f"{len(report.damaged_states)} damaged states, {len(report.other_model_states)} states of other models")
