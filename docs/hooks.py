"""mkdocs hook: the CLI reference is generated from the commands' own `--help`."""

from __future__ import annotations

from typing import Any


def _helps() -> str:
    import typer
    from typer.testing import CliRunner

    from kvrag.cli import app

    runner = CliRunner()
    parts: list[str] = []

    def walk(command: Any, path: list[str]) -> None:
        shown = runner.invoke(app, [*path, "--help"], env={"NO_COLOR": "1", "COLUMNS": "100", "TERM": "dumb"})
        parts.append(f"## `{' '.join(['kvrag', *path])}`\n\n```text\n{shown.stdout.strip()}\n```\n")
        if hasattr(command, "list_commands"):  # a group: its commands too
            ctx = command.context_class(command)
            for name in command.list_commands(ctx):
                walk(command.get_command(ctx, name), [*path, name])

    walk(typer.main.get_command(app), [])
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if "{{ cli_reference }}" in markdown:
        markdown = markdown.replace("{{ cli_reference }}", _helps())
    return markdown
