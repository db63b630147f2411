"""A Python process with the heavy imports done that runs each code block in a forked child: a fresh
process per block, without paying torch's, transformers' and kvrag's imports each time.

The parent only imports; it never runs a torch operation, so no thread pool exists when it forks.
Each request is one JSON line on stdin ({"code", "cwd", "env"}); the child changes to `cwd`, takes
`env` as its whole environment, runs the code as `__main__` with its output in two files, and
exits with its status; the parent answers one JSON line ({"status", "stdout", "stderr"}).
"""

import json
import os
import sys
import tempfile
import traceback

import torch  # noqa: F401
import transformers  # noqa: F401

import kvrag  # noqa: F401
from kvrag import KVEngine  # noqa: F401


def child(code: str, cwd: str, env: dict, out: str, err: str) -> None:
    status = 0
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["-c"]
        out_fd, err_fd = os.open(out, os.O_WRONLY | os.O_TRUNC), os.open(err, os.O_WRONLY | os.O_TRUNC)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        exec(compile(code, "<block>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as a user's interpreter would
        traceback.print_exc()
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def main() -> None:
    answers = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        with tempfile.TemporaryDirectory() as folder:
            out, err = os.path.join(folder, "out"), os.path.join(folder, "err")
            for path in (out, err):
                open(path, "w").close()
            pid = os.fork()
            if pid == 0:
                child(request["code"], request["cwd"], request["env"], out, err)
            _, raw = os.waitpid(pid, 0)
            status = os.waitstatus_to_exitcode(raw)
            with open(out) as o, open(err) as e:
                answers.write(json.dumps({"status": status, "stdout": o.read(), "stderr": e.read()}) + "\n")
            answers.flush()


if __name__ == "__main__":
    main()
