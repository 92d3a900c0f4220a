"""Many invocations of a CLI's main() in ONE subprocess: each argv's exit code, stdout and stderr as a user's
`python -m MODULE ARGS` would show them, but one interpreter (and one torch import) for them all. For usage
errors, which exit before anything runs: a bad-input table of 20 rows was 20 launches (~2-7 s each on a 2-core
box). Each row runs main(argv) with its own streams; an exception other than SystemExit is printed as Python's
traceback, exit 1, as the interpreter would."""
from __future__ import annotations

import json
import subprocess
import sys

_RUNNER = r"""
import contextlib, importlib, io, json, sys, traceback
module, rows = sys.argv[1], json.loads(sys.stdin.read())
main = importlib.import_module(module).main
out = []
for argv in rows:
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            code = main(argv) or 0
        except SystemExit as x:
            code = x.code if isinstance(x.code, int) else (0 if x.code is None else 1)
            if not isinstance(x.code, (int, type(None))):
                print(x.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    out.append([code, o.getvalue(), e.getvalue()])
print(json.dumps(out))
"""


def run_all(module: str, rows: list[list[str]], *, env: dict, cwd: str | None = None, timeout: float = 300) -> list:
    """[(exit code, stdout, stderr)] of `python -m module *argv` for each argv of `rows`, in one subprocess."""
    r = subprocess.run([sys.executable, "-c", _RUNNER, module], input=json.dumps(rows), capture_output=True,
                       text=True, timeout=timeout, env=env, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return [tuple(x) for x in json.loads(r.stdout.splitlines()[-1])]
