"""What every `kvrag` command shares: the consoles, the model, store and trust options, building an
engine, failing with one line, reading text and showing progress.

Nothing here imports torch: `kvrag --help` (and every command's `--help`) answers without it."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Literal, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from kvrag.errors import InputError

if TYPE_CHECKING:
    from kvrag.engine.engine import KVEngine

__all__ = ["err", "out", "MODEL", "DTYPE", "ATTN", "STORE", "LAYOUT", "NAMESPACE", "SIGNING_KEY_FILE", "DEADLINE",
           "THREADS", "JSON", "MAX_TOKENS", "Dtype", "Attn", "Layout", "Trust", "engine_for", "fail", "read_text",
           "progress", "show_warnings"]

err = Console(stderr=True)
out = Console()

Dtype = Literal["float32", "bfloat16", "float16"]
# the first is the default, `kvrag.models.loading.DEFAULT_ATTN` (spelled out: `--help` does not import torch)
Attn = Literal["invariant", "sdpa", "eager"]
Layout = Literal["chat", "completion"]

MODEL = typer.Option("smollm2-135m", "--model", help="smollm2-135m, gemma3-270m, tiny-random-<family>, a model folder, "
                     "or a Hugging Face id already in the local cache")
DTYPE = typer.Option("float32", "--dtype", help="the model's dtype; states are only found by the same dtype")
ATTN = typer.Option("invariant", "--attn", help="invariant: a graft equals one stock pass over the whole prompt; sdpa, "
                    "eager: transformers' own (a graft equals the same segments read again). Part of the model "
                    "fingerprint")
LAYOUT = typer.Option(None, "--layout", help="chat (the model's chat template) or completion (a plain prompt, for "
                      "base models); default: chat when the model has a template. Part of every state's key")
STORE = typer.Option(None, "--store", help="store URL, e.g. disk://./states or redis://127.0.0.1:6379/0,disk://./states "
                     "(tiers, hot first; default: a disk store in the user cache)")
NAMESPACE = typer.Option(None, "--namespace", envvar="KVRAG_NAMESPACE", help="the tenant whose states this command reads "
                         "and writes (its key is derived from the signing key)")
SIGNING_KEY_FILE = typer.Option(None, "--signing-key-file",
                                help="a file holding the key that signs and addresses states; machines sharing a store "
                                "need the same key (default: $KVRAG_SIGNING_KEY, else the file $KVRAG_SIGNING_KEY_FILE "
                                "names, else this user's generated key)")
DEADLINE = typer.Option(None, "--deadline", envvar="KVRAG_DEADLINE_S", min=0.001, max=3600,
                        help="seconds a question waits on store reads before the text answers [default: 5]")
THREADS = typer.Option(None, "--threads", envvar="KVRAG_THREADS", min=1, max=512,
                       help="torch threads (default: torch's; under sdpa and eager part of the hardware fingerprint)")
JSON = typer.Option(False, "--json", help="print one JSON document instead of tables")
MAX_TOKENS = typer.Option(64, "--max-tokens", min=1, help="the most tokens an answer may have")


class Trust:
    """The trust options as one value: namespace, signing key file, deadline, threads."""

    def __init__(self, namespace: Optional[str] = None, signing_key_file: Optional[str] = None,
                 deadline: Optional[float] = None, threads: Optional[int] = None) -> None:
        self.namespace, self.signing_key_file, self.deadline, self.threads = namespace, signing_key_file, deadline, threads

    def engine_kwargs(self) -> dict[str, object]:
        kwargs: dict[str, object] = {}
        if self.namespace is not None:
            kwargs["namespace"] = self.namespace
        if self.signing_key_file:
            kwargs["signing_key"] = signing_key(self.signing_key_file)
        if self.deadline is not None:
            kwargs["deadline_s"] = self.deadline
        return kwargs

    def apply_threads(self) -> None:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)


def engine_for(model: str, store: Optional[str], dtype: str, attn: str, layout: Optional[str] = None,
               trust: Trust | None = None) -> "KVEngine":
    """The one place the CLI builds an engine."""
    from kvrag.engine.engine import KVEngine

    trust = trust or Trust()
    trust.apply_threads()
    return KVEngine.open(model, store, dtype=dtype, attn=attn, layout=layout, **trust.engine_kwargs())  # type: ignore[arg-type]


def signing_key(signing_key_file: Optional[str]) -> Optional[bytes]:
    """The key a `--signing-key-file` names (None: the library's own precedence,
    `kvrag.trust.signing.resolve_signing_key`)."""
    if not signing_key_file:
        return None
    from kvrag.trust.signing import read_key_file

    return read_key_file(signing_key_file)


def fail(e: Exception) -> None:
    """One line on stderr (never wrapped, never a traceback), exit status 2."""
    message = " ".join(str(e).split())
    err.print(f"[bold red]error:[/] {escape(message[:500])}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def read_text(path: str) -> str:
    """A text file ('-': standard input), as UTF-8; unreadable input is an `InputError`."""
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it first") from e
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror or e}") from e


def progress(quiet: bool = False) -> Progress:
    """A progress bar on stderr with done/total, elapsed time and an ETA; silent under `--json`
    (`quiet`) or when stderr is not a terminal."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("ETA"), TimeRemainingColumn(), console=err, transient=True,
        disable=quiet or not err.is_terminal,
    )


def show_warnings() -> None:
    """kvrag's warnings on stderr, one line each, `kvrag: warning: ...` (once per process)."""
    logger = logging.getLogger("kvrag")
    if not any(getattr(h, "kvrag_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_OneLine())
        handler.kvrag_cli = True  # type: ignore[attr-defined]
        handler.setLevel(logging.WARNING)
        logger.addHandler(handler)


class _OneLine(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"kvrag: {record.levelname.lower()}: {' '.join(record.getMessage().split())}"


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def duration_seconds(text: str) -> float:
    """`90s`, `30m`, `12h`, `7d`, `2w` or a plain number of seconds, as seconds."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in _UNITS else (text, "s")
    try:
        seconds = float(number) * _UNITS[unit]
    except ValueError:
        raise InputError(f"a duration is a number and one of s, m, h, d, w (90s, 30m, 12h, 7d), not {text!r}") from None
    if not 0 <= seconds < float("inf"):
        raise InputError(f"a duration must be 0 or more, not {text!r}")
    return seconds
