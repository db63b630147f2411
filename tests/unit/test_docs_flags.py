"""Every command-line flag the README and the docs mention exists: on the `kvrag` command a line
names, else on some `kvrag` command, benchmark or example script, or on the other tools the docs
quote (pip, systemctl, llama-server). The CLI reference itself is generated from the commands' `--help` (`docs/hooks.py`),
so every flag that exists is documented there."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import typer

from kvrag.cli import app

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
#: flags of tools other than kvrag's that the docs quote (pip, systemctl, llama-server), and click's own
OTHER_TOOLS = {"--help", "--no-deps", "--index-url", "--now", "--slot-save-path"}


def command_flags() -> dict[str, set[str]]:
    """Each `kvrag` command path ("ab", "tenant-key", ...) -> its flags (both forms of a switch)."""
    found: dict[str, set[str]] = {}

    def walk(command: Any, path: list[str]) -> None:
        found[" ".join(path)] = {o for p in getattr(command, "params", []) for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        if hasattr(command, "list_commands"):
            ctx = command.context_class(command)
            for name in command.list_commands(ctx):
                walk(command.get_command(ctx, name), [*path, name])

    walk(typer.main.get_command(app), [])
    return found


def script_flags() -> set[str]:
    sources = [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/**/*.py"), *ROOT.glob("integrations/**/*.py")]
    return {f for p in sources for f in re.findall(r"[\"'](--[a-z][a-z0-9-]*)[\"']", p.read_text(encoding="utf-8"))}


def unknown_flags(text: str, commands: dict[str, set[str]], scripts: set[str]) -> list[str]:
    """Flags of `text` that nothing has, and flags on a `kvrag <command>` line that command lacks."""
    known = set().union(*commands.values()) | scripts | OTHER_TOOLS
    unknown = [f"{flag}: no command has it" for flag in FLAG.findall(text) if flag not in known]
    for line in re.findall(r"(?:^|`|\s)((?:\.venv/bin/)?kvrag [^`\n]*)", text):
        try:
            words = shlex.split(line.split(" #")[0])
        except ValueError:  # an unclosed quote in prose
            words = line.split()
        path = []
        for word in words[1:]:
            if word.startswith("-") or " ".join([*path, word]) not in commands:
                break
            path.append(word)
        if not path:
            continue
        mine = commands[" ".join(path)]
        unknown += [f"{flag}: not a flag of kvrag {' '.join(path)}" for flag in FLAG.findall(line.split(" #")[0])
                    if flag not in mine]
    return unknown


def test_every_flag_the_docs_mention_exists():
    commands, scripts = command_flags(), script_flags()
    assert len(commands) > 10 and "--order" in commands["ab"]
    assert {page.name: unknown_flags(page.read_text(encoding="utf-8"), commands, scripts) for page in PAGES
            if unknown_flags(page.read_text(encoding="utf-8"), commands, scripts)} == {}


def test_a_planted_unknown_flag_is_found():
    commands, scripts = command_flags(), script_flags()
    page = ("Run `kvrag ab --k 3 --order canonical`, then `kvrag ab --shuffle-docs`.\n\n"
            "```bash\nkvrag serve --k 3 --port 8000\n```\n")
    assert unknown_flags(page, commands, scripts) == ["--shuffle-docs: no command has it",
                                                      "--shuffle-docs: not a flag of kvrag ab",
                                                      "--k: not a flag of kvrag serve"]
