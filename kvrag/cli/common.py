"""What every `kvrag` command shares: the consoles, the model and store options, building an
engine, failing with one line, reading text and showing progress."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvrag.errors import KVRagError

if TYPE_CHECKING:
    from kvrag.engine.engine import KVEngine

__all__ = ["err", "out", "MODEL", "DTYPE", "ATTN", "STORE", "LAYOUT", "engine_for", "fail", "read_text", "progress"]

err = Console(stderr=True)
out = Console()

MODEL = typer.Option("smollm2-135m", "--model", help="smollm2-135m, gemma3-270m, tiny-random-<family>, a folder or a HF id")
DTYPE = typer.Option("float32", "--dtype", help="float32 or bfloat16 (states are only found by the same dtype)")
# the default is `kvrag.models.loading.DEFAULT_ATTN` (spelled out: `--help` does not import torch)
ATTN = typer.Option("invariant", "--attn", help="invariant (the default: a graft equals one stock pass over the whole prompt), sdpa or eager (transformers' own: a graft equals the same segments read again); part of the model fingerprint")
LAYOUT = typer.Option(None, "--layout", help="chat (the model's chat template) or completion (a plain completion "
                      "prompt, for base models); default: chat when the model has a template. Part of every state's key")
STORE = typer.Option(None, "--store", help="store URL, e.g. disk://./states or redis://127.0.0.1:6379/0,disk://./states "
                     "(default: disk store in the user cache)")


def engine_for(model: str, store: Optional[str], dtype: str, attn: str, layout: Optional[str] = None) -> "KVEngine":
    """The one place the CLI builds an engine."""
    from kvrag.engine.engine import KVEngine

    return KVEngine.open(model, store, dtype=dtype, attn=attn, layout=layout)


def fail(e: Exception) -> None:
    """One line on stderr (never wrapped, never a traceback), exit status 2."""
    message = " ".join(str(e).split())
    err.print(f"[bold red]error:[/] {escape(message[:500])}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def read_text(path: str) -> str:
    """A text file ('-': standard input), as UTF-8; unreadable input is a `KVRagError`."""
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise KVRagError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it first") from e
    except OSError as e:
        raise KVRagError(f"cannot read {path}: {e.strerror or e}") from e


def progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err, transient=True,
    )
