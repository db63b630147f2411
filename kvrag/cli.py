"""The `kvrag` command line. Every command takes `--help`, which shows an example."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvrag.errors import KVRagError

if TYPE_CHECKING:
    from kvrag.engine import KVEngine

app = typer.Typer(
    help="kvrag: deposit a model's KV states once, graft them byte-exact, fall back to text.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console()


MODEL = typer.Option("smollm2-135m", "--model", help="smollm2-135m, tiny-random-<family>, a folder or a HF id")
DTYPE = typer.Option("float32", "--dtype", help="float32 or bfloat16 (states are only found by the same dtype)")
ATTN = typer.Option("sdpa", "--attn", help="sdpa or eager (part of the model fingerprint)")
STORE = typer.Option(None, "--store", help="store URL, e.g. disk://./states or redis://127.0.0.1:6379/0,disk://./states "
                     "(default: disk store in the user cache)")


def _engine(model: str, store: Optional[str], dtype: str, attn: str) -> "KVEngine":
    """The one place the CLI builds an engine."""
    from kvrag.engine import KVEngine

    return KVEngine.open(model, store, dtype=dtype, attn=attn)


def _fail(e: Exception) -> None:
    """One line on stderr (never wrapped, never a traceback), exit status 2."""
    message = " ".join(str(e).split())
    err.print(f"[bold red]error:[/] {escape(message[:500])}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _read_text(path: str) -> str:
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


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err, transient=True,
    )


@app.command(epilog="Example: kvrag verify --model tiny-random-gemma3 --dtype bfloat16 --attn eager --samples 50 --json")
def verify(
    model: str = MODEL,
    dtype: str = DTYPE,
    attn: str = ATTN,
    samples: int = typer.Option(50, min=1, help="(document, question) pairs from the bundled text"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
) -> None:
    """Check that grafted states give byte-identical logits to a fresh computation."""
    from kvrag.models import load_model
    from kvrag.verify import verify_model

    try:
        loaded = load_model(model, dtype=dtype, attn=attn)
        with _progress() as bar:
            task = bar.add_task(f"verify {model} {dtype} {attn}", total=samples)
            report = verify_model(loaded, samples=samples, progress=lambda done, _n: bar.update(task, completed=done))
    except KVRagError as e:
        _fail(e)
    if as_json:
        print(report.model_dump_json(indent=2))
        return
    table = Table(title=f"kvrag verify: {model}, {report.dtype}, {report.attn}, {report.samples} samples "
                        f"({report.prompt_tokens_min}-{report.prompt_tokens_max} prompt tokens)")
    for column in ("graft vs", "byte-exact", "KL max", "argmax agreement", "max |diff|"):
        table.add_column(column, justify="right")
    table.add_row("fresh, same schedule", f"{report.byte_exact}/{report.samples}", f"{report.kl_max:.3g}",
                  f"{report.argmax_agreement:.2%}", f"{report.max_abs_diff:.3g}")
    table.add_row("text fallback", f"{report.fallback_byte_exact}/{report.samples}", "", "", "")
    table.add_row("chain states vs from scratch (payload SHA-256)",
                  f"{report.chain_states_byte_exact}/{report.chain_states}", "", "", "")
    mono = report.monolithic
    table.add_row("one monolithic pass (approx.)", f"{mono.byte_exact}/{mono.samples}", f"{mono.kl_max:.3g}",
                  f"{mono.argmax_agreement:.2%}", f"{mono.max_abs_diff:.3g}")
    out.print(table)
    out.print(f"model fingerprint {report.model_fingerprint[:16]}  hardware fingerprint {report.hardware_fingerprint[:16]}")


@app.command(epilog="Example: kvrag demo --questions 4")
def demo(
    model: str = MODEL,
    store: Optional[str] = STORE,
    dtype: str = DTYPE,
    attn: str = ATTN,
    questions: int = typer.Option(6, min=1, help="how many bundled questions to ask"),
) -> None:
    """Deposit the bundled documents, then answer questions by graft and by text, side by side."""
    from kvrag.demo import run_demo

    try:
        with err.status(f"loading {model}") as status:
            rows = run_demo(_engine(model, store, dtype, attn), questions=questions, on_step=lambda m: status.update(m))
    except KVRagError as e:
        _fail(e)
    table = Table(title=f"kvrag demo: {model}, graft vs text re-prefill of the same tokens", show_lines=True)
    table.add_column("question / answer", ratio=3)
    table.add_column("graft", justify="right")
    table.add_column("text", justify="right")
    table.add_column("speed-up", justify="right")
    table.add_column("same logits", justify="center")
    for row in rows:
        g, t = row.graft.receipt, row.text.receipt
        answer = row.graft.text if row.graft.text == row.text.text else f"graft: {row.graft.text}\ntext:  {row.text.text}"
        table.add_row(
            f"[bold]{row.question}[/]\n{answer}",
            f"{g.mode}\n{g.timings.ttft_ms:.0f} ms",
            f"{t.mode}\n{t.timings.ttft_ms:.0f} ms",
            f"{t.timings.ttft_ms / g.timings.ttft_ms:.1f}x",
            "yes" if g.first_token_logits_sha256 == t.first_token_logits_sha256 else "[red]NO[/]",
        )
    out.print(table)
    out.print("TTFT = time to first token. 'same logits': SHA-256 of the first-token logits is equal in both arms.")


@app.command(epilog="Example: kvrag deposit notes.txt --model tiny-random-llama --store disk://./states")
def deposit(
    files: list[str] = typer.Argument(..., help="text files; '-' reads standard input"),
    model: str = MODEL,
    store: Optional[str] = STORE,
    dtype: str = DTYPE,
    attn: str = ATTN,
    chain: bool = typer.Option(False, help="deposit the files as one chain, in order"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Deposit documents as verified states and print their refs."""
    try:
        texts = [_read_text(f) for f in files]
        engine = _engine(model, store, dtype, attn)
        refs = engine.deposit_chain(texts) if chain else [engine.deposit(t) for t in texts]
    except KVRagError as e:
        _fail(e)
    if as_json:
        print(json.dumps([r.model_dump() for r in refs], indent=2))
    else:
        for f, r in zip(files, refs):
            out.print(f"{r.key}  {r.token_count:>6} tokens at {r.start}  {f}")


@app.command(epilog="Example: kvrag ask 'Who built the lighthouse?' --doc lighthouse.txt --json")
def ask(
    question: str = typer.Argument(...),
    doc: list[str] = typer.Option([], "--doc", help="document files, in prompt order"),
    model: str = MODEL,
    store: Optional[str] = STORE,
    dtype: str = DTYPE,
    attn: str = ATTN,
    max_new_tokens: int = typer.Option(64, min=1),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Answer a question after the given documents, grafting their stored states where possible."""
    try:
        texts = [_read_text(f) for f in doc]
        engine = _engine(model, store, dtype, attn)
        generation = engine.generate(question, states=texts, max_new_tokens=max_new_tokens)
    except KVRagError as e:
        _fail(e)
    if as_json:
        print(json.dumps({"answer": generation.text, "receipt": generation.receipt.model_dump()}, indent=2))
    else:
        r = generation.receipt
        out.print(generation.text)
        err.print(f"[dim]{r.mode}, {r.tokens_reused} tokens reused, {r.tokens_prefilled} prefilled, "
                  f"TTFT {r.timings.ttft_ms:.0f} ms, logits {r.first_token_logits_sha256[:16]}[/]")


@app.command("ls", epilog="Example: kvrag ls --store redis://127.0.0.1:6379/0,disk://./states --json")
def ls_states(
    store: Optional[str] = STORE,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """List the states in a store, tier by tier."""
    from kvrag.maintenance import list_states
    from kvrag.stores import open_store

    try:
        infos = list(list_states(open_store(store)))
    except KVRagError as e:
        _fail(e)
    if as_json:
        print(json.dumps([i.model_dump() for i in infos], indent=2))
        return
    table = Table(title=f"{len(infos)} states")
    for column in ("key", "tier", "model", "start", "tokens", "size", "parent", "signed"):
        table.add_column(column)
    for i in infos:
        size = f"{i.payload_bytes / 2**20:.1f} MiB" if i.payload_bytes is not None else ""
        table.add_row(i.key[:16], i.tier, i.model or f"[red]{i.error}[/]", str(i.start or 0), str(i.tokens or ""),
                      size, (i.parent_key or "")[:12], "yes" if i.signed else "no")
    out.print(table)


@app.command(epilog="Example: kvrag inspect 3f2a...e9 --store disk://./states --json")
def inspect(
    key: str = typer.Argument(..., help="a state key (64 hex characters)"),
    store: Optional[str] = STORE,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Show a state's manifest in each tier and check its payload there."""
    from kvrag.maintenance import inspect_state
    from kvrag.stores import open_store

    try:
        found = inspect_state(open_store(store), key)
    except KVRagError as e:
        _fail(e)
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
                      f"signed: {'yes' if manifest['signature'] else 'no'}")


@app.command(epilog="Example: kvrag gc --store redis://127.0.0.1:6379/0 --other-models --model smollm2-135m --dry-run")
def gc(
    store: Optional[str] = STORE,
    other_models: bool = typer.Option(False, "--other-models", help="also drop states of other model fingerprints"),
    model: str = MODEL,
    dtype: str = DTYPE,
    attn: str = ATTN,
    dry_run: bool = typer.Option(False, "--dry-run", help="report, delete nothing"),
    grace: float = typer.Option(600.0, "--grace", min=0, help="seconds: temporary files and orphan frames younger "
                                "than this may belong to a write in progress and are kept"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Drop orphan frames, stray temporary files and damaged states (and other models' states on request)."""
    from kvrag.maintenance import collect_garbage
    from kvrag.stores import open_store

    try:
        keep = None
        if other_models:
            keep = _engine(model, store, dtype, attn).fingerprint
        report = collect_garbage(open_store(store), keep_fingerprint=keep, dry_run=dry_run, grace_s=grace)
    except KVRagError as e:
        _fail(e)
    if as_json:
        print(report.model_dump_json(indent=2))
        return
    verb = "would drop" if dry_run else "dropped"
    out.print(f"{verb}: {report.orphan_frames} orphan frames, {report.stray_files} stray files, "
              f"{len(report.damaged_states)} damaged states, {len(report.other_model_states)} states of other models")


@app.command(epilog="Example: kvrag ab --docs docs.jsonl --questions questions.jsonl --k 2 --json ab.json --report ab-report")
def ab(
    docs: Optional[str] = typer.Option(None, help='DOCS.jsonl, lines {"id", "title", "text"} (default: the bundled sample set)'),
    questions: Optional[str] = typer.Option(None, help='QUESTIONS.jsonl, lines {"id", "question", "answers": [...]} (+ "doc_id", "recurring")'),
    model: str = MODEL,
    store: Optional[str] = STORE,
    dtype: str = DTYPE,
    attn: str = ATTN,
    k: int = typer.Option(1, min=1, help="documents retrieved per question"),
    max_new_tokens: int = typer.Option(32, min=1),
    json_path: Optional[str] = typer.Option(None, "--json", help="write the summary and rows to this file"),
    report: Optional[str] = typer.Option(None, help="write report.md and PNG plots into this folder"),
) -> None:
    """Compare text RAG and KV RAG on the same retrieval, prompt and decoding."""
    from kvrag.ab import load_jsonl, run_ab, write_report
    from kvrag.samples import sample_paths

    default_docs, default_questions = sample_paths()
    try:
        doc_rows = load_jsonl(docs or default_docs, ["id", "title", "text"])
        question_rows = load_jsonl(questions or default_questions, ["id", "question", "answers"])
        engine = _engine(model, store, dtype, attn)
        with _progress() as bar:
            task = bar.add_task("A/B", total=len(question_rows))
            summary = run_ab(engine, doc_rows, question_rows, k=k, max_new_tokens=max_new_tokens,
                             progress=lambda done, _n: bar.update(task, completed=done))
        if report:
            path = write_report(summary, report)
            err.print(f"report: {path}")
    except KVRagError as e:
        _fail(e)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(summary.model_dump_json(indent=2))
    table = Table(title=f"kvrag ab: {summary.model}, k={summary.k}, {summary.n} questions")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name in ("accuracy_text", "accuracy_kv", "answer_agreement", "logits_byte_exact_rate", "answer_agreement_monolithic",
                 "ttft_text_ms_median", "ttft_kv_ms_median", "ttft_ratio_median", "prefill_tokens_text", "prefill_tokens_kv",
                 "decode_tokens_text", "decode_tokens_kv", "memo_hits"):
        value = getattr(summary, name)
        table.add_row(name, f"{value:.3g}" if isinstance(value, float) else str(value))
    out.print(table)


library_app = typer.Typer(
    help="A verified solution library: add problems with solutions, solve new ones.",
    epilog="Example: kvrag library add problems.jsonl && kvrag library solve 'A rope of 45 m is cut into 3 m pieces. How many?'",
    no_args_is_help=True,
)
app.add_typer(library_app, name="library")


@library_app.command("add", epilog="Example: kvrag library add problems.jsonl --verifier mypkg.checks:is_correct")
def library_add(
    file: str = typer.Argument(..., help='JSONL lines {"id", "problem", "solution", "answer"}'),
    model: str = MODEL,
    store: Optional[str] = STORE,
    dtype: str = DTYPE,
    attn: str = ATTN,
    verifier: Optional[str] = typer.Option(None, help="module:function(problem, solution, answer) -> bool (default: the solution ends in its answer)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Verify solutions and deposit the verified ones as states (and memo entries)."""
    from kvrag.ab import load_jsonl
    from kvrag.library import Library

    try:
        items = load_jsonl(file, ["id", "problem", "solution", "answer"])
        library = Library(_engine(model, store, dtype, attn))
        with _progress() as bar:
            task = bar.add_task("library add", total=len(items))
            result = library.add(items, verifier, progress=lambda done: bar.update(task, completed=done))
    except KVRagError as e:
        _fail(e)
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
    dtype: str = DTYPE,
    attn: str = ATTN,
    k: int = typer.Option(2, min=1, help="closest verified solutions to graft for a new problem"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Answer a problem: a recurring one from its memo entry, a new one with the closest solutions grafted."""
    from kvrag.library import Library

    try:
        generation, used = Library(_engine(model, store, dtype, attn)).solve(problem, k=k)
    except KVRagError as e:
        _fail(e)
    if as_json:
        print(json.dumps({"answer": generation.text, "used": [e.id for e in used], "receipt": generation.receipt.model_dump(mode="json")}, indent=2))
    else:
        out.print(generation.text)
        err.print(f"[dim]{generation.receipt.mode}, {generation.receipt.decode_tokens} decode tokens"
                  f"{', using ' + ', '.join(e.id for e in used) if used else ''}[/]")


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
