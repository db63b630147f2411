"""Install kvrag as the README says, into a new virtualenv, then run every Python block of the README
and its shell quickstart there: what a newcomer who skips `make` meets.

    python .ci/readme_install.py [--keep DIR]     # `make readme`; a few minutes (it installs torch)

Runs the README's install block line by line (its `pip` is the new environment's), then every
`pip install` the README's prose names that points at the checkout (the examples extra), then each
Python block in its own fresh folder, then the `kvrag ask` lines, with a new `KVRAG_HOME`. Exits non-zero at the first
failure, printing the line that failed."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.DOTALL)


def install_lines() -> list[str]:
    """The install block's lines, then the prose's `pip install` of a checkout path."""
    block = next(b for b in blocks("bash") if "pip install" in b)
    lines = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip().startswith("pip install")]
    prose = re.findall(r"`(pip install [^`]*\./[^`]*)`", README)
    return lines + prose


def run(command: list[str], cwd: Path, env: dict[str, str]) -> None:
    print("$", shlex.join(command), flush=True)
    done = subprocess.run(command, cwd=cwd, env=env)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {shlex.join(command)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", type=Path, help="make the environment here and keep it (default: a temporary folder)")
    args = parser.parse_args()
    where = args.keep or Path(tempfile.mkdtemp(prefix="kvrag-readme-"))
    venv = where / "venv"
    # a new user too: converted models, signing key, default store and native kernel made afresh
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVRAG_HOME": str(where / "home"),
           "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("VIRTUAL_ENV", None)
    run([sys.executable, "-m", "venv", str(venv)], ROOT, env)
    python = str(venv / "bin" / "python")
    for line in install_lines():
        run([python, "-m", *shlex.split(line)], ROOT, env)
    for i, code in enumerate(blocks("python"), 1):
        folder = where / f"block{i}"
        folder.mkdir(exist_ok=True)
        (folder / "block.py").write_text(code, encoding="utf-8")
        run([python, "block.py"], folder, env)
    shell = next(b for b in blocks("bash") if "kvrag ask" in b)
    for line in shell.splitlines():
        command = line.split("  #")[0].strip()
        if command:
            run(["bash", "-c", command], where, env)
    print(f"README: {len(install_lines())} install lines and {len(blocks('python'))} Python blocks ran in {venv}")


if __name__ == "__main__":
    main()
