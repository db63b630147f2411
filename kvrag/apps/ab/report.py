"""The A/B report: `report.md` and its plots, from an `ABSummary` (needs `kvrag[report]`)."""

from __future__ import annotations

from pathlib import Path

from kvrag.apps.ab.results import ABSummary
from kvrag.errors import InputError

__all__ = ["write_report", "summary_rows"]


def summary_rows(summary: ABSummary) -> list[tuple[str, str]]:
    """The summary's figures as (name, value) text, for a table."""
    names = ("accuracy_text", "accuracy_kv", "accuracy_text_retrieval_order", "answer_agreement", "logits_byte_exact_rate", "answer_agreement_monolithic",
             "monolithic_byte_exact_rate",
             "ttft_text_ms_median", "ttft_kv_ms_median", "ttft_ratio_median", "ttft_ratio_p90", "ttft_ratio_sum",
             "per_token_text_ms_median", "per_token_kv_ms_median", "total_text_ms_median", "total_kv_ms_median",
             "prefill_tokens_text", "prefill_tokens_kv",
             "decode_tokens_text", "decode_tokens_kv", "memo_hits", "full_hit_rate", "token_reuse_rate", "bytes_stored",
             "upfront_deposit_ms", "deposit_before_ms", "deposit_after_ms", "approximate_rows", "kl_mean_approximate",
             "argmax_agreement_approximate")
    if summary.accuracy_stock is not None:
        names = (*names[:2], "accuracy_stock", *names[2:])
    rows = [(n, f"{v:.3g}" if isinstance(v := getattr(summary, n), float) else str(v)) for n in names]
    rows.append(("mode_mix", ", ".join(f"{m} {n}" for m, n in summary.mode_mix.items())))
    rows.append(("ttft_ratio_by_mode", ", ".join(f"{m} {v:.1f}x" for m, v in summary.ttft_ratio_by_mode.items())))
    return rows


def write_report(summary: ABSummary, folder: str | Path) -> Path:
    """`report.md` with three PNG plots beside it: TTFT by prompt length, prefill tokens, agreement."""
    try:
        import matplotlib
    except ImportError as e:
        raise InputError("the A/B report's plots need matplotlib: pip install 'kvrag[report]'") from e

    matplotlib.use("Agg")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _plot_ttft(summary, folder / "ttft_by_length.png")
    _plot_prefill(summary, folder / "prefill_tokens.png")
    _plot_agreement(summary, folder / "agreement.png")
    lines = [*_figures(summary), "",
             "![TTFT by prompt length](ttft_by_length.png)", "",
             "![Prefill tokens](prefill_tokens.png)", "",
             "![Agreement](agreement.png)", "",
             *_row_table(summary)]
    path = folder / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _plot_ttft(summary: ABSummary, path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = summary.rows
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, attr, marker in (("text RAG (re-read)", "ttft_text_ms", "o"), ("KV RAG (graft / memo)", "ttft_kv_ms", "s")):
        ax.scatter([r.prompt_tokens for r in rows], [getattr(r, attr) for r in rows], label=label, marker=marker)
    ax.set_xlabel("prompt tokens (documents + question)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_yscale("log")
    ax.set_title(f"Time to first token, {summary.model}, k={summary.k}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_prefill(summary: ABSummary, path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = summary.rows
    fig, ax = plt.subplots(figsize=(8, 4.2))
    positions = range(len(rows))
    ax.bar([p - 0.2 for p in positions], [r.prefill_tokens_text for r in rows], width=0.4, label="text RAG")
    ax.bar([p + 0.2 for p in positions], [r.prefill_tokens_kv for r in rows], width=0.4, label="KV RAG")
    ax.set_xticks(list(positions), [r.id for r in rows], rotation=60, fontsize=7)
    ax.set_ylabel("tokens prefilled")
    ax.set_title(f"Prefill tokens: {summary.prefill_tokens_text:,} (text) vs {summary.prefill_tokens_kv:,} (KV)")
    ax.set_ylim(0, max([r.prefill_tokens_text for r in rows] + [1]) * 1.2)
    ax.legend(loc="upper center", ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_agreement(summary: ABSummary, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = ["accuracy\ntext", "accuracy\nKV", "answer\nagreement", "logits\nbyte-exact", "agreement vs\nmonolithic"]
    values = [summary.accuracy_text, summary.accuracy_kv, summary.answer_agreement, summary.logits_byte_exact_rate,
              summary.answer_agreement_monolithic]
    bars = ax.bar(labels, values, color=["#7a9cc6", "#7a9cc6", "#5aa469", "#5aa469", "#d4a373"])
    ax.bar_label(bars, [f"{v:.2f}" for v in values])
    ax.set_ylim(0, 1.1)
    ax.set_title("Agreement (exact rows) and accuracy (all rows)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _figures(summary: ABSummary) -> list[str]:
    """The report's title and its table of figures."""
    s = summary
    return [
        f"# kvrag A/B: {s.model}, k={s.k}, store `{s.store}`, policy {s.policy}"
        + (f", levers: {', '.join(s.levers)}" if s.levers else ""),
        "",
        "| figure | value |", "|---|---:|",
        f"| questions | {s.n} ({s.recurring} recurring) |",
        f"| KV modes | {', '.join(f'{m} {n}' for m, n in s.mode_mix.items())} |",
        f"| median TTFT ratio per mode | {', '.join(f'{m} {v:.1f}x' for m, v in s.ttft_ratio_by_mode.items())} |",
        f"| whole context grafted (rows) | {s.full_hit_rate:.2f} |",
        f"| KV tokens reused / prefilled | {s.tokens_reused_kv:,} / {s.prefill_tokens_kv:,} ({s.token_reuse_rate:.0%} reused) |",
        f"| deposits: up front / before questions / after answers | {s.upfront_deposit_ms:,.0f} ms / "
        f"{s.deposit_before_ms:,.0f} ms / {s.deposit_after_ms:,.0f} ms |",
        *([f"| blend {s.blend_ratio}: approximate rows, mean KL, argmax agreement vs the text arm | "
           f"{s.approximate_rows}, {s.kl_mean_approximate:.3g}, {s.argmax_agreement_approximate:.2f} |"]
          if s.blend_ratio is not None else []),
        f"| accuracy, text RAG / KV RAG | {s.accuracy_text:.2f} / {s.accuracy_kv:.2f} |",
        *([f"| accuracy, the same model on a plain completion prompt (stock transformers) | {s.accuracy_stock:.2f} |"]
          if s.accuracy_stock is not None else []),
        f"| answer agreement (exact rows) | {s.answer_agreement:.2f} |",
        f"| first-token logits byte-exact (exact rows) | {s.logits_byte_exact_rate:.2f} |",
        f"| answer agreement with a stock `model.generate` (one pass) | {s.answer_agreement_monolithic:.2f} |",
        f"| first-token logits byte-exact with that stock pass | {s.monolithic_byte_exact_rate:.2f} |",
        f"| median TTFT, text / KV | {s.ttft_text_ms_median:.0f} ms / {s.ttft_kv_ms_median:.0f} ms |",
        f"| median TTFT ratio | {s.ttft_ratio_median:.1f}x |",
        f"| median time per decoded token, text / KV | {s.per_token_text_ms_median:.1f} ms / {s.per_token_kv_ms_median:.1f} ms |",
        f"| median answer time (end to end), text / KV | {s.total_text_ms_median:.0f} ms / {s.total_kv_ms_median:.0f} ms |",
        f"| prefill tokens, text / KV | {s.prefill_tokens_text:,} / {s.prefill_tokens_kv:,} |",
        f"| decode tokens, text / KV | {s.decode_tokens_text:,} / {s.decode_tokens_kv:,} |",
        f"| memo hits | {s.memo_hits} |",
    ]


def _row_table(summary: ABSummary) -> list[str]:
    """One line per question."""
    lines = ["| id | question | KV answer | modes (text / KV) | TTFT text / KV | per token text / KV | answer text / KV "
             "| hit text / KV | levers |",
             "|---|---|---|---|---:|---:|---:|---|---|"]
    for r in summary.rows:
        answer = r.kv_answer.replace("|", "\\|").replace("\n", " ")
        order = ("reordered, answer differs from retrieval order" if r.answer_changed_by_order
                 else "reordered" if r.order_changed else "")
        if r.kv_mode == "approximate-graft":
            order += ("; " if order else "") + ("blended, answer differs from text" if r.answer_changed_by_blend
                                                else "blended, same answer")
        lines.append(f"| {r.id} | {r.question} | {answer} | {r.text_mode} / {r.kv_mode} | "
                     f"{r.ttft_text_ms:.0f} / {r.ttft_kv_ms:.0f} ms | {r.per_token_text_ms:.1f} / {r.per_token_kv_ms:.1f} ms | "
                     f"{r.total_text_ms:.0f} / {r.total_kv_ms:.0f} ms | {r.text_hit} / {r.kv_hit} | {order} |")
    return lines
