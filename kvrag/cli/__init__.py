"""The command line, `kvrag ...` (typer): the commands (`main`), shared options (`common`), and
the `ab`, `library` and `serve` groups. `python -m kvrag.cli` runs it too."""

from kvrag.cli.main import app

__all__ = ["app"]
