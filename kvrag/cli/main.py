"""The `kvrag` command line. Every command takes `--help`, which shows an example."""

from __future__ import annotations

import json
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from kvrag.cli.ab import register as register_ab
from kvrag.cli.common import (
    ATTN,
    DEADLINE,
    DTYPE,
    JSON,
    LAYOUT,
    MAX_TOKENS,
    MODEL,
    NAMESPACE,
    SIGNING_KEY_FILE,
    STORE,
    THREADS,
    Attn,
    Dtype,
    Layout,
    Trust,
    engine_for,
    err,
    fail,
    out,
    progress,
    read_text,
    show_warnings,
    signing_key,
)
from kvrag.cli.library import library_app
from kvrag.cli.serve import register as register_serve
from kvrag.cli.stores import register as register_stores
from kvrag.errors import KVRagError

app = typer.Typer(
    help="kvrag: deposit a model's KV states once, graft them byte-exact, fall back to text.",
    epilog="Example: kvrag deposit notes.txt && kvrag ask 'Who built the lighthouse?' --doc notes.txt",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from kvrag.version import VERSION

        print(f"kvrag {VERSION}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print kvrag's version and exit"),
) -> None:
    """kvrag: deposit a model's KV states once, graft them byte-exact, fall back to text."""
    show_warnings()


@app.command(epilog="Example: kvrag verify --model tiny-random-gemma3 --dtype bfloat16 --attn eager --samples 50 --json")
def verify(
    model: str = MODEL,
    dtype: Dtype = DTYPE,
    attn: Attn = ATTN,
    samples: int = typer.Option(50, min=1, help="(document, question) pairs from the bundled text"),
    threads: Optional[int] = THREADS,
    as_json: bool = JSON,
) -> None:
    """Check that grafted states give byte-identical logits to a fresh computation."""
    from kvrag.apps.verify import verify_model
    from kvrag.models.loading import load_model

    try:
        Trust(threads=threads).apply_threads()
        loaded = load_model(model, dtype=dtype, attn=attn)
        with progress(as_json) as bar:
            task = bar.add_task(f"verify {model} {dtype} {attn}", total=samples)
            report = verify_model(loaded, samples=samples, progress=lambda done, _n: bar.update(task, completed=done))
    except KVRagError as e:
        fail(e)
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
    table.add_row("one monolithic stock pass" + ("" if report.attn == "invariant" else " (approx.)"), f"{mono.byte_exact}/{mono.samples}", f"{mono.kl_max:.3g}",
                  f"{mono.argmax_agreement:.2%}", f"{mono.max_abs_diff:.3g}")
    out.print(table)
    out.print(f"model fingerprint {report.model_fingerprint[:16]}  hardware fingerprint {report.hardware_fingerprint[:16]}")


@app.command(epilog="Example: kvrag demo --questions 4")
def demo(
    model: str = MODEL,
    store: Optional[str] = STORE,
    dtype: Dtype = DTYPE,
    attn: Attn = ATTN,
    questions: int = typer.Option(6, min=1, help="how many bundled questions to ask"),
    namespace: Optional[str] = NAMESPACE,
    signing_key_file: Optional[str] = SIGNING_KEY_FILE,
    deadline: Optional[float] = DEADLINE,
    threads: Optional[int] = THREADS,
) -> None:
    """Deposit the bundled documents, then answer questions by graft and by text, side by side."""
    from kvrag.apps.demo import run_demo

    try:
        with err.status(f"loading {model}") as status:
            engine = engine_for(model, store, dtype, attn, None, Trust(namespace, signing_key_file, deadline, threads))
            rows = run_demo(engine, questions=questions, on_step=lambda m: status.update(m))
    except KVRagError as e:
        fail(e)
    table = Table(title=f"kvrag demo: {model}, graft vs text re-prefill of the same tokens", show_lines=True)
    table.add_column("question / answer", ratio=3)
    table.add_column("graft", justify="right")
    table.add_column("text", justify="right")
    table.add_column("text / graft", justify="right")
    table.add_column("same logits", justify="center")
    for row in rows:
        g, t = row.graft.receipt, row.text.receipt
        answer = row.graft.text if row.graft.text == row.text.text else f"graft: {row.graft.text}\ntext:  {row.text.text}"
        table.add_row(
            f"[bold]{row.question}[/]\n{answer}",
            _demo_cell(g),
            _demo_cell(t),
            f"TTFT {t.timings.ttft_ms / g.timings.ttft_ms:.1f}x\nanswer {t.timings.total_ms / g.timings.total_ms:.1f}x",
            "yes" if g.first_token_logits_sha256 == t.first_token_logits_sha256 else "[red]NO[/]",
        )
    out.print(table)
    out.print("TTFT = time to first token; per token = each token after it; answer = end to end. "
              "'same logits': SHA-256 of the first-token logits is equal in both arms.")


def _demo_cell(receipt: Any) -> str:
    """An arm's mode and times in the demo's table."""
    t = receipt.timings
    return f"{receipt.mode}\nTTFT {t.ttft_ms:.0f} ms\n{t.per_token_ms:.0f} ms/token\nanswer {t.total_ms:.0f} ms"


@app.command(epilog="Example: kvrag deposit notes.txt --model tiny-random-llama --store disk://./states")
def deposit(
    files: list[str] = typer.Argument(..., help="text files; '-' reads standard input"),
    model: str = MODEL,
    store: Optional[str] = STORE,
    dtype: Dtype = DTYPE,
    attn: Attn = ATTN,
    layout: Optional[Layout] = LAYOUT,
    chain: bool = typer.Option(False, help="deposit the files as one chain, in order"),
    namespace: Optional[str] = NAMESPACE,
    signing_key_file: Optional[str] = SIGNING_KEY_FILE,
    deadline: Optional[float] = DEADLINE,
    threads: Optional[int] = THREADS,
    as_json: bool = JSON,
) -> None:
    """Deposit documents as verified states and print their refs."""
    try:
        texts = [read_text(f) for f in files]
        engine = engine_for(model, store, dtype, attn, layout, Trust(namespace, signing_key_file, deadline, threads))
        if chain:
            refs = engine.deposit_chain(texts)
        else:
            refs = []
            with progress(as_json or len(texts) < 2) as bar:
                task = bar.add_task("deposit", total=len(texts))
                for text in texts:
                    refs.append(engine.deposit(text))
                    bar.advance(task)
    except KVRagError as e:
        fail(e)
    if as_json:
        print(json.dumps([r.model_dump() for r in refs], indent=2))
    else:
        for f, r in zip(files, refs):
            out.print(f"{r.key}  {r.token_count:>6} tokens at {r.start}  {f}", soft_wrap=True, highlight=False)


@app.command(epilog="Example: kvrag ask 'Who built the lighthouse?' --doc lighthouse.txt --json")
def ask(
    question: str = typer.Argument(...),
    doc: list[str] = typer.Option([], "--doc", help="document files, in prompt order"),
    model: str = MODEL,
    store: Optional[str] = STORE,
    dtype: Dtype = DTYPE,
    attn: Attn = ATTN,
    layout: Optional[Layout] = LAYOUT,
    max_tokens: int = MAX_TOKENS,
    deposit: bool = typer.Option(True, "--deposit/--no-deposit", help="deposit what was read as text after answering, "
                                 "so the next question over these documents grafts them (as the adapters and the "
                                 "server do)"),
    namespace: Optional[str] = NAMESPACE,
    signing_key_file: Optional[str] = SIGNING_KEY_FILE,
    deadline: Optional[float] = DEADLINE,
    threads: Optional[int] = THREADS,
    as_json: bool = JSON,
) -> None:
    """Answer a question after the given documents, grafting their stored states where possible."""
    try:
        texts = [read_text(f) for f in doc]
        engine = engine_for(model, store, dtype, attn, layout, Trust(namespace, signing_key_file, deadline, threads))
        generation = engine.generate(question, states=texts, max_new_tokens=max_tokens, deposit_missing=deposit)
    except KVRagError as e:
        fail(e)
    if as_json:
        print(json.dumps({"answer": generation.text, "receipt": generation.receipt.model_dump()}, indent=2))
    else:
        r = generation.receipt
        out.print(generation.text)
        err.print(f"[dim]{r.mode}, {r.tokens_reused} tokens reused, {r.tokens_prefilled} prefilled, "
                  f"TTFT {r.timings.ttft_ms:.0f} ms, logits {r.first_token_logits_sha256[:16]}[/]", soft_wrap=True)


@app.command(epilog="Example: kvrag explain --doc lighthouse.txt --doc keeper.txt --model gemma3-270m --attn sdpa --json")
def explain(
    doc: list[str] = typer.Option(..., "--doc", help="document files, in prompt order (as given to ask)"),
    model: str = MODEL,
    store: Optional[str] = STORE,
    dtype: Dtype = DTYPE,
    attn: Attn = ATTN,
    layout: Optional[Layout] = LAYOUT,
    namespace: Optional[str] = NAMESPACE,
    signing_key_file: Optional[str] = SIGNING_KEY_FILE,
    deadline: Optional[float] = DEADLINE,
    threads: Optional[int] = THREADS,
    as_json: bool = JSON,
) -> None:
    """Why would these documents not graft? For each one: whether this engine finds its state, and
    if not, what is stored for the same text under other settings (model, dtype, kernel, thread
    count, layout, position) and which fields differ. Only states signed with your key are read."""
    from kvrag.core.whereabouts import foreign_sentence
    from kvrag.errors import StateError

    try:
        texts = [read_text(f) for f in doc]
        engine = engine_for(model, store, dtype, attn, layout, Trust(namespace, signing_key_file, deadline, threads))
        rows = []
        for path, segment in zip(doc, engine.plan(texts)):
            try:
                engine.check(segment)
                verdict, reason = "grafts", None
            except StateError as e:
                verdict, reason = "reads text", f"{e.reason}: {e}"
            seen = [] if verdict == "grafts" else engine.whereabouts.sightings(segment)
            others = engine.whereabouts.other_keys(segment) if verdict != "grafts" and not seen else 0
            rows.append({"doc": path, "key": segment.key, "start": segment.start, "tokens": len(segment.ids),
                         "layout": segment.layout, "verdict": verdict, "reason": reason,
                         "elsewhere": [s.model_dump() for s in seen], "other_keys": others})
    except KVRagError as e:
        fail(e)
    if as_json:
        print(json.dumps({"model": engine.model.name, "fingerprint": engine.fingerprint,
                          "num_threads": engine.identity.hardware.num_threads, "documents": rows}, indent=2))
        return
    threads = engine.identity.hardware.num_threads
    out.print(f"{engine.model.name} {dtype} {attn}, layout {engine.layout.kind}, "
              f"{'threads ' + str(threads) if threads is not None else 'any thread count'}, store {engine.store.url}")
    for row in rows:
        out.print(f"[bold]{escape(row['doc'])}[/]: {row['verdict']} (state {row['key'][:12]}, {row['tokens']} tokens at {row['start']})")
        if row["reason"]:
            out.print(f"  {escape(row['reason'])}", soft_wrap=True)
        for s in row["elsewhere"]:
            out.print(f"  stored: {s['key'][:12]} ({s['model']}, {s['token_count']} tokens at {s['start']}, layout "
                      f"{s['layout'] or '?'})", soft_wrap=True)
            for d in s["differences"]:
                out.print(f"    {d['field']}: {escape(d['stored'])} stored, {escape(d['needed'])} here", soft_wrap=True)
        if row["other_keys"]:
            out.print(f"  {foreign_sentence(row['other_keys'])}", soft_wrap=True)
        elif row["reason"] and not row["elsewhere"]:
            out.print("  nothing stored for this text, under your key or (as far as the store says) any other",
                      soft_wrap=True)


@app.command("tenant-key", epilog="Example: KVRAG_SIGNING_KEY=... kvrag tenant-key acme > acme.key   (hand acme.key to acme)")
def tenant_key(
    tenant: str = typer.Argument(..., help="the tenant's name: its namespace in every store"),
    signing_key_file: Optional[str] = SIGNING_KEY_FILE,
) -> None:
    """Print a tenant's key, derived from the operator's (--signing-key-file, else $KVRAG_SIGNING_KEY, else your key file).

    The tenant signs, seals and addresses with it (KVRAG_SIGNING_KEY=<it>); holding it reveals
    nothing of any other tenant's states, memo or records."""
    from kvrag.trust import derive_tenant_key, resolve_signing_key

    try:
        print(derive_tenant_key(resolve_signing_key(signing_key(signing_key_file)), tenant).decode())
    except KVRagError as e:
        fail(e)


register_ab(app)
register_stores(app)
register_serve(app)
app.add_typer(library_app, name="library")


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
