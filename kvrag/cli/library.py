"""`kvrag library`: verified solutions deposited as states, recurring problems answered from them."""

from __future__ import annotations

import json
from typing import Optional

import typer

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
    err,
    fail,
    out,
    progress,
)
from kvrag.errors import KVRagError

__all__ = ["library_app"]

library_app = typer.Typer(
    help="A verified solution library: add problems with solutions, solve new ones.",
    epilog="Example: kvrag library add problems.jsonl && kvrag library solve 'A rope of 45 m is cut into 3 m pieces. How many?'",
    no_args_is_help=True,
)


@library_app.command("add", epilog="Example: kvrag library add problems.jsonl --verifier mypkg.checks:is_correct")
def library_add(
    file: str = typer.Argument(..., help='JSONL lines {"id", "problem", "solution", "answer"}'),
    model: str = MODEL,
    store: Optional[str] = STORE,
    dtype: Dtype = DTYPE,
    attn: Attn = ATTN,
    verifier: Optional[str] = typer.Option(None, help="module:function(problem, solution, answer) -> bool (default: the solution ends in its answer)"),
    namespace: Optional[str] = NAMESPACE,
    signing_key_file: Optional[str] = SIGNING_KEY_FILE,
    deadline: Optional[float] = DEADLINE,
    threads: Optional[int] = THREADS,
    as_json: bool = JSON,
) -> None:
    """Verify solutions and deposit the verified ones as states (and memo entries)."""
    from kvrag.apps.ab import load_jsonl
    from kvrag.apps.library import Library

    try:
        items = load_jsonl(file, ["id", "problem", "solution", "answer"])
        library = Library(engine_for(model, store, dtype, attn, None, Trust(namespace, signing_key_file, deadline, threads)))
        with progress(as_json) as bar:
            task = bar.add_task("library add", total=len(items))
            result = library.add(items, verifier, progress=lambda done: bar.update(task, completed=done))
    except KVRagError as e:
        fail(e)
    if as_json:
        print(result.model_dump_json(indent=2))
    else:
        out.print(f"added {len(result.added)}, rejected by the verifier {len(result.rejected)} "
                  f"({', '.join(result.rejected) or '-'}), already there {len(result.already)}")


@library_app.command("solve", epilog="Example: kvrag library solve 'A baker makes 12 loaves an hour for 7 hours. How many loaves?'")
def library_solve(
    problem: str = typer.Argument(...),
    model: str = MODEL,
    store: Optional[str] = STORE,
    dtype: Dtype = DTYPE,
    attn: Attn = ATTN,
    k: int = typer.Option(2, min=1, help="closest verified solutions to graft for a new problem"),
    namespace: Optional[str] = NAMESPACE,
    signing_key_file: Optional[str] = SIGNING_KEY_FILE,
    deadline: Optional[float] = DEADLINE,
    threads: Optional[int] = THREADS,
    as_json: bool = JSON,
) -> None:
    """Answer a problem: a recurring one from its memo entry, a new one with the closest solutions grafted."""
    from kvrag.apps.library import Library

    try:
        generation, used = Library(engine_for(model, store, dtype, attn, None, Trust(namespace, signing_key_file, deadline, threads))).solve(problem, k=k)
    except KVRagError as e:
        fail(e)
    if as_json:
        print(json.dumps({"answer": generation.text, "used": [e.id for e in used], "receipt": generation.receipt.model_dump(mode="json")}, indent=2))
    else:
        out.print(generation.text)
        err.print(f"[dim]{generation.receipt.mode}, {generation.receipt.decode_tokens} decode tokens"
                  f"{', using ' + ', '.join(e.id for e in used) if used else ''}[/]")
