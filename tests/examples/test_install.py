"""The product as a stranger installs it: README's install command, run from an empty directory into a
fresh virtual environment, then from another empty directory a 30-line adapter of a non-GPT model runs
every gate through the plugin and writes ./reports/verify-report.{json,md} there, and nothing is written
into site-packages. And PyPI's other `verify` (an assertion library, same import name) beside ours is one
line saying how to fix it, not a traceback.

(The venv uses --system-site-packages so torch, pytest and hypothesis come from this interpreter: no
multi-GB download. pip runs as the README says, build isolation included.)"""
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from _xtrain_pytest import conflict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = ["pyproject.toml", "README.md", "xtrain_core", "xtrain_proof", "verify", "_xtrain_pytest", "_xtrain_cli"]
CLONE = "/path/to/xtrain"  # the README's placeholder for a clone


def _readme_line(prefix: str) -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        found = [ln.strip() for ln in f if ln.strip().startswith(prefix)]
    assert found, f"README.md has no line starting with {prefix!r}"
    return found[0]


def _clone(dst) -> None:
    for name in SOURCES:
        s = os.path.join(ROOT, name)
        if os.path.isdir(s):
            shutil.copytree(s, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            dst.mkdir(exist_ok=True)
            shutil.copy(s, dst / name)


def _tree(folder: str) -> dict:
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, folder)] = os.stat(p).st_mtime_ns
    return out


def test_readme_test_command_is_what_ci_runs():
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        last = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")][-1]
    assert last == _readme_line("python -m venv .venv && "), last
    # a fresh environment on every run: the one made by an earlier run is removed first
    assert "rm -rf .venv" in open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()


@pytest.mark.slow
def test_documented_install_from_an_empty_directory_proves_a_users_trainer(tmp_path):
    clone = tmp_path / "xtrain"
    _clone(clone)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    empty = tmp_path / "empty"
    empty.mkdir()
    cmd = shlex.split(_readme_line(f'python -m pip install torch==2.13.0 "{CLONE}[test]"').split("#")[0])
    cmd = [py if a == "python" else a.replace(CLONE, str(clone)) for a in cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=empty, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert list(empty.iterdir()) == []
    where = subprocess.run([py, "-c", "import verify, sysconfig, importlib.metadata as m; print(verify.__file__); "
                            "print(sysconfig.get_paths()['purelib']); print(m.version('xtrain-verify'))"],
                           capture_output=True, text=True, env=env, check=True, cwd=empty).stdout.split()
    site = where[1]
    assert where[0].startswith(str(venv)) and where[2] == "0.1.0", where  # the installed copy, not this checkout
    ours = [os.path.join(site, p) for p in ("verify", "xtrain_core", "_xtrain_pytest", "_xtrain_cli")]
    before = [_tree(p) for p in ours]

    user = tmp_path / "user"
    user.mkdir()
    shutil.copy(os.path.join(ROOT, "examples", "mlp_regressor.py"), user / "my_mlp.py")
    r = subprocess.run([py, "-m", "pytest", "--pyargs", "verify", "--verify-trainer", "my_mlp:factory", "-q"],
                       capture_output=True, text=True, cwd=user, timeout=600,
                       env={**env, "HYPOTHESIS_PROFILE": "dev", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    rep = json.loads((user / "reports" / "verify-report.json").read_text())
    assert rep["trainer"] == "my_mlp:factory" and rep["gates"]["equivalence"]["examples"] > 0
    assert rep["gates"]["bit-exact"]["examples"] > 0 and (user / "reports" / "verify-report.md").is_file()
    after = [_tree(p) for p in ours]
    assert after == before, [sorted(set(a) - set(b)) for a, b in zip(after, before)]  # nothing written there


# -- PyPI's verify 1.1.1 beside ours -------------------------------------------------------------------

def _theirs(folder, *, with_ours: bool):
    """A `verify` package as verify 1.1.1 leaves it: its own files (__meta__.py, base.py, ...), alone or
    mixed into ours (then our __init__.py, installed last, won)."""
    pkg = folder / "verify"
    if with_ours:
        shutil.copytree(os.path.join(ROOT, "verify"), pkg, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("from .base import expect\n")
    (pkg / "__meta__.py").write_text("__title__ = 'verify'\n__version__ = '1.1.1'\n")
    (pkg / "base.py").write_text("def expect(value):\n    return value\n")
    return pkg


def test_conflict_check_knows_ours_from_theirs(tmp_path):
    assert conflict.check(os.path.join(ROOT, "verify")) is None
    assert "pip uninstall -y verify xtrain-verify" in conflict.check(str(_theirs(tmp_path / "a", with_ours=True)))
    alone = conflict.check(str(_theirs(tmp_path / "b", with_ours=False)))
    assert "not xtrain-verify's package" in alone and "pip uninstall -y verify" in alone


@pytest.mark.parametrize("with_ours", [False, True], ids=["theirs_shadows_ours", "files_mixed"])
def test_pypis_verify_beside_ours_is_one_line(tmp_path, with_ours):
    _theirs(tmp_path / "site", with_ours=with_ours)
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}", "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"], capture_output=True,
                       text=True, cwd=run, env=env, timeout=120)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 4 and len(lines) == 1 and lines[0].startswith("ERROR: xtrain-verify: "), lines
    assert ("not xtrain-verify's package" in lines[0]) == (not with_ours)
    assert "pip uninstall -y verify xtrain-verify" in lines[0] and "Traceback" not in r.stderr
    if with_ours:  # our __init__ won: import verify works, and warns once
        r = subprocess.run([sys.executable, "-c", "import verify"], capture_output=True, text=True, cwd=run, env=env)
        assert r.returncode == 0 and "RuntimeWarning: xtrain-verify: the import name 'verify'" in r.stderr, r.stderr
