"""The product as a stranger installs it: a non-editable install in a fresh virtual environment, then
from an empty directory elsewhere a 30-line adapter of a non-GPT model runs every gate through the
plugin and writes ./reports/verify-report.{json,md} there, and nothing is written into site-packages.

(The venv reaches this interpreter's packages — torch, hypothesis, pip — through a .pth file naming a
folder of links to them, without xtrain's own install: a venv inside a venv would otherwise see only the
base interpreter's packages, and an editable xtrain seen there would be a second, different install.
So the install takes seconds; `pip install --no-deps` installs our package only, from a copy of the
source tree.)"""
import json
import os
import shutil
import site as pysite
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["pyproject.toml", "README.md", "xtrain_core", "verify", "_xtrain_pytest"]
OURS = ("xtrain", "__editable__", "verify", "_xtrain_pytest", "examples")  # this checkout's install, if any


def _tree(folder: str) -> dict:
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, folder)] = os.stat(p).st_mtime_ns
    return out


@pytest.mark.slow
def test_installed_plugin_proves_a_users_trainer_from_an_empty_directory(tmp_path):
    src = tmp_path / "src"
    for name in SOURCES:
        s = os.path.join(ROOT, name)
        (shutil.copytree(s, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
         if os.path.isdir(s) else (src.mkdir(exist_ok=True), shutil.copy(s, src / name)))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    own = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                         text=True, check=True, env=env).stdout.strip()
    view = tmp_path / "outer-site"
    view.mkdir()
    for d in pysite.getsitepackages():
        for entry in os.listdir(d) if os.path.isdir(d) else []:
            if not entry.startswith(OURS) and not (view / entry).exists():
                os.symlink(os.path.join(d, entry), view / entry)
    with open(os.path.join(own, "_outer_site.pth"), "w") as f:  # appended after the venv's own site-packages
        f.write(f"{view}\n")
    r = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(src)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    where = subprocess.run([py, "-c", "import verify, sysconfig; print(verify.__file__); print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, env=env, check=True, cwd=tmp_path).stdout.split()
    site = where[1]
    assert where[0].startswith(str(venv)), where  # the installed copy, not this checkout
    ours = [os.path.join(site, p) for p in ("verify", "xtrain_core", "_xtrain_pytest")]
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
    assert rep["gates"]["bit_exact"]["examples"] > 0 and (user / "reports" / "verify-report.md").is_file()
    after = [_tree(p) for p in ours]
    assert after == before, [sorted(set(a) - set(b)) for a, b in zip(after, before)]  # nothing written there
