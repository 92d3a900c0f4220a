"""Settings are read once and passed (issue 27 item 2): the knobs are read from os.environ in verify/_internal/settings.py
only, built from it (Settings.from_env) at the entry points only, and nothing in verify/ writes os.environ but
settings.set_library_env (what torch and friends read in-process); a pool rank runs under its parent's Settings,
whatever its own environment says; a pool job's verdict crosses the process boundary as the verdict object."""
from __future__ import annotations

import ast
import pathlib

import pytest

from tests.helpers import dist_jobs
from verify._internal.settings import Settings, current, launcher_var, set_library_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SETTINGS = "verify/_internal/settings.py"
# the processes' entry points: each builds its Settings once (the plugin from pytest's options), then installs them
ENTRIES = {"verify/_internal/plugin.py", "verify/run.py", "verify/gpu_gate.py", "verify/selftest/__main__.py", SETTINGS}
ENV_FUNCS = {"getenv", "putenv", "unsetenv", "environ", "environb", "getenvb"}


def _modules():
    for p in sorted((ROOT / "verify").rglob("*.py")):
        yield p.relative_to(ROOT).as_posix(), ast.parse(p.read_text(encoding="utf-8"))


def _env_uses(tree) -> list[int]:
    """Lines that touch the process environment: os.environ / os.getenv / os.putenv ..., or their names imported."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr in ENV_FUNCS and isinstance(n.value, ast.Name) and n.value.id == "os":
            out.append(n.lineno)
        elif isinstance(n, ast.ImportFrom) and n.module == "os" and any(a.name in ENV_FUNCS for a in n.names):
            out.append(n.lineno)
    return out


def _writers(tree) -> set[str]:
    """The functions of a module that write os.environ (item assignment or deletion, update, setdefault, pop,
    clear, putenv, unsetenv)."""
    out = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for n in ast.walk(fn):
            target = None
            if isinstance(n, (ast.Assign, ast.AugAssign, ast.Delete)):
                for t in getattr(n, "targets", None) or [getattr(n, "target", None)]:
                    if isinstance(t, ast.Subscript):
                        target = t.value
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                if n.func.attr in ("update", "setdefault", "pop", "popitem", "clear"):
                    target = n.func.value
                elif n.func.attr in ("putenv", "unsetenv"):
                    out.add(fn.name)
            if isinstance(target, ast.Attribute) and target.attr == "environ":
                out.add(fn.name)
    return out


def test_only_the_settings_module_touches_os_environ():
    found = {path: lines for path, tree in _modules() if path != SETTINGS and (lines := _env_uses(tree))}
    assert found == {}, f"these read or write os.environ; go through verify._internal.settings (knobs: Settings): {found}"


def test_only_set_library_env_writes_os_environ():
    writers = {path: sorted(w) for path, tree in _modules() if (w := _writers(tree))}
    assert writers == {SETTINGS: ["set_library_env"]}, writers


def test_settings_are_built_from_the_environment_at_the_entry_points_only():
    callers = {path for path, tree in _modules() for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and n.attr == "from_env"}
    assert callers == ENTRIES, callers ^ ENTRIES


def test_the_checks_can_fail():
    bad = ast.parse("import os\nfrom os import environ\ndef f():\n    os.environ['X'] = '1'\n"
                    "def g():\n    os.environ.update(X='1')\ndef h():\n    return os.getenv('X')\n")
    assert sorted(_env_uses(bad)) == [2, 4, 6, 8] and _writers(bad) == {"f", "g"}


def test_no_knob_passes_around_the_settings():
    with pytest.raises(TypeError, match="XTRAIN_DIST_TIMEOUT is the variable of knob 'timeout'"):
        launcher_var("XTRAIN_DIST_TIMEOUT")
    with pytest.raises(TypeError, match="XTRAIN_TEST_DEVICE is the variable of knob 'device'"):
        set_library_env({"XTRAIN_TEST_DEVICE": "cuda"})


def test_the_settings_cross_a_process_boundary_whole():
    s = Settings.from_env({"XTRAIN_DIST_TIMEOUT": "7"}, device="cpu", backend="gloo")
    t = Settings.from_dict(s.to_dict())
    assert t == s and t.sources == s.sources and t.where("timeout") == "XTRAIN_DIST_TIMEOUT=7.0"
    import pickle

    u = pickle.loads(pickle.dumps(s))
    assert u == s and u.sources == s.sources


@pytest.mark.distributed
@pytest.mark.slow  # ~4 s: a spawned rank imports torch afresh (CI only)
def test_a_pool_rank_uses_its_parents_settings_whatever_its_environment(monkeypatch):
    """A spawned rank inherits this process's environment as it is when the rank starts: the knobs there say
    otherwise (timeout 5, 1 thread), the rank still runs under the Settings its pool was built with (timeout 77)."""
    from verify._internal.ranks.pool import RankPool

    mine = current().replace(timeout=77.0, pool_start="spawn", threads=1)
    monkeypatch.setenv("XTRAIN_DIST_TIMEOUT", "5")
    monkeypatch.setenv("XTRAIN_POOL_START", "forkserver")
    pool = RankPool(1, "gloo", settings=mine)
    try:
        (seen, environ), = pool.run(dist_jobs.settings_seen)
    finally:
        pool.close()
    assert environ["XTRAIN_DIST_TIMEOUT"] == "5" and environ["XTRAIN_POOL_START"] == "forkserver"
    assert Settings.from_dict(seen) == mine and seen["timeout"] == 77.0 and seen["pool_start"] == "spawn"


@pytest.mark.distributed
def test_a_pool_job_returns_the_verdict_object():
    """gate_job on a rank returns GateResult / GateFailure / GateSkipped themselves (pickled); run_alone raises the
    failure and the skip in the parent as one process would, fields and message unchanged."""
    from verify._internal.cases.case import Case
    from verify._internal.gates.single import gate_job
    from verify._internal.ranks.pool import get_pool
    from verify._internal.verdict import Gate, GateFailure, GateResult, GateSkipped

    case = Case(accum_steps=1, micro_batch=1, steps=1)
    pool = get_pool(1)
    ok, fail, skip = (pool.run(gate_job, dist_jobs.verdict_of, kind, case)[0] for kind in ("ok", "fail", "skip"))
    assert isinstance(ok, GateResult) and ok.gate is Gate.EQUIVALENCE and ok.ratio == 0.5 and ok.case == case
    assert isinstance(fail, GateFailure) and str(fail) == "[equivalence] differs" and fail.gate is Gate.EQUIVALENCE
    assert (fail.error, fail.bound, fail.hint) == (2.0, 1.0, "a hint")
    assert type(skip) is GateSkipped and str(skip) == "does not apply here"
