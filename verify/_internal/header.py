"""The one report header (schema_version, machine_info, git commit, UTC time) and atomic writes, for
every report the harness and the benchmarks write."""
from __future__ import annotations

import datetime
import os
import re
import platform
import subprocess
import tempfile

from verify._internal.settings import current, env_of, fp32_only  # noqa: F401  (fp32_only: its home is the device set-up)

# The distribution's name on the package index ("xtrain" there is an unrelated project); the import names
# are verify and xtrain_core. Code that looks the installed distribution up uses this constant.
DISTRIBUTION = "xtrain-verify"


def _git(*args: str, where: str | None = None) -> str | None:
    try:
        r = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=where or os.getcwd())
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_commit(where: str | None = None) -> str | None:
    """HEAD's sha of the repository at `where` (default: the invoking directory, i.e. the code under
    test, not this installed package); XTRAIN_GIT_COMMIT wins (GPU machines get trees without .git)."""
    return current().git_commit or _git("rev-parse", "HEAD", where=where) or None


def git_state(where: str | None = None) -> dict:
    """git_commit plus where it came from, the branch and whether tracked files differ from HEAD (None
    where there is no git repository: a copied tree names its commit through XTRAIN_GIT_COMMIT)."""
    head = _git("rev-parse", "HEAD", where=where)
    status = _git("status", "--porcelain", "--untracked-files=no", where=where) if head else None
    source = env_of("git_commit") if current().git_commit else ("git" if head else None)
    return dict(commit=current().git_commit or head or None, commit_source=source,  # git_commit's rule, head once
                branch=_git("rev-parse", "--abbrev-ref", "HEAD", where=where) if head else None,
                dirty=None if status is None else bool(status))


def commit_text(doc: dict, short: int | None = None) -> str:
    """A report header's commit as a reader sees it: "commit `sha`" (+ " (dirty)" where git said so), or
    "not a git checkout" where the invoking directory is none (a user's folder, a copied tree)."""
    sha = doc.get("git_commit")
    if not sha:
        return "not a git checkout"
    dirty = " (dirty)" if (doc.get("git") or {}).get("dirty") else ""
    return f"commit `{sha[:short] if short else sha}{dirty}`"


def version() -> str:
    try:
        from importlib.metadata import version as v

        return v(DISTRIBUTION)
    except Exception:  # noqa: BLE001  (running from a source tree that was never installed: read its pyproject)
        try:
            path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "pyproject.toml")
            with open(path, encoding="utf-8") as f:
                found = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M)
            return f"{found.group(1)} (source tree)" if found else "unknown"
        except OSError:
            return "unknown"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine_info(device=None) -> dict:
    """The machine a report was measured on. `gpu` and `driver` are None unless `device` is a CUDA one."""
    import torch  # here, not at the top: the pytest plugin reads versions() without paying torch's import

    info = dict(python=platform.python_version(), platform=platform.platform(), node=platform.node(),
                cpu_count=os.cpu_count(), cpu_model=_cpu_model(), torch=torch.__version__, cuda=torch.version.cuda,
                threads=torch.get_num_threads(), gpu=None, driver=None,
                load_avg=os.getloadavg() if hasattr(os, "getloadavg") else None)  # the box may be shared
    if device is not None and torch.device(device).type == "cuda":
        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        info["gpu"] = props.name
        info["gpu_total_bytes"] = props.total_memory
        info["gpu_count"] = torch.cuda.device_count()
        info["cudnn"] = torch.backends.cudnn.version()
        v = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
        info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else (str(v) if v else None)
        try:
            import pynvml

            pynvml.nvmlInit()
            d = pynvml.nvmlSystemGetDriverVersion()
            info["driver"] = d.decode() if isinstance(d, bytes) else d
        except Exception as e:  # NVML missing or failing: record why, never crash a report
            info["driver"] = f"unknown ({type(e).__name__})"
    return info


SCHEMA_VERSION = 1

# The distributions whose behaviour a verdict depends on: the harness's own machinery first, then the
# frameworks the recipes drive. A fresh machine resolves the newest releases pyproject allows, so every report
# and every pytest run's header names what was resolved (a new release is then visible where it changed things).
DEPENDENCIES = ("torch", "numpy", "hypothesis", "pytest", "pytest-xdist", "nvidia-ml-py", "matplotlib",
                "transformers", "accelerate", "lightning", "trl")


def versions() -> dict:
    """{distribution: version} of DEPENDENCIES that are installed (absent ones are left out)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as v

    out = {}
    for name in DEPENDENCIES:
        try:
            out[name] = v(name)
        except PackageNotFoundError:
            pass
    return out


def versions_text(found: dict | None = None) -> str:
    """One line: `torch 2.13.0+cpu, hypothesis 6.170.17, …` (the pytest header and the reports print it)."""
    return ", ".join(f"{k} {x}" for k, x in (versions() if found is None else found).items())


def header(kind: str, device=None) -> dict:
    """The header every report carries (verify.report_header): schema_version, kind, the machine (of `device`),
    the git commit and its state (where it came from, the branch, dirty), UTC time, and the releases of xtrain-verify
    and of each dependency found."""
    git = git_state()  # the commit, where it came from, the branch, dirty: one set of git calls
    return dict(schema_version=SCHEMA_VERSION, kind=kind, machine_info=machine_info(device),
                git_commit=git.pop("commit"), git=git, utc=utc_now(), xtrain_version=version(), versions=versions())


def atomic_write(path, data: str | bytes | None = None, mode: int = 0o644) -> list[str]:
    """Write to a temp file in the same folder, then os.replace: readers see the old file or the new one.
    Reports are for reading: mode 0644 (mkstemp alone would leave 0600). `path` a dict {path: data}: several files,
    all or none (atomic_write_all). Returns the paths written."""
    if isinstance(path, dict):
        if data is not None:
            raise TypeError("atomic_write({path: data, ...}) takes no data argument: the dict holds each file's")
        return atomic_write_all(path, mode)
    return atomic_write_all({path: data}, mode)


def atomic_write_all(files: dict, mode: int = 0o644) -> list[str]:
    """Several files, all or none: every one is written (and fsynced) to a temp file beside its target
    first, and only then are they all os.replace'd into place. An error before that point leaves every
    target as it was and removes the temp files. Returns the paths written, in order."""
    temps = []
    try:
        for path, data in files.items():
            path = os.fspath(path)
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
            temps.append((tmp, path))
            with os.fdopen(fd, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
        for tmp, path in temps:
            os.replace(tmp, path)
    except BaseException:
        for tmp, _ in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise
    return [path for _, path in temps]
