"""The one report header (schema_version, machine_info, git commit, UTC time) and atomic writes, for
every report the harness and the benchmarks write."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import tempfile

import torch


def fp32_only() -> None:
    """TF32 off for matmuls and convolutions: every GPU measurement and gate here means true fp32, as the
    anchor measured it. (Newer torch prefers fp32_precision and may warn; the effect is the same.)"""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def git_commit(where: str | None = None) -> str | None:
    """HEAD's sha of the repository at `where` (default: the invoking directory, i.e. the code under
    test, not this installed package); XTRAIN_GIT_COMMIT wins (GPU machines get trees without .git)."""
    if os.environ.get("XTRAIN_GIT_COMMIT"):
        return os.environ["XTRAIN_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=where or os.getcwd()).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def version() -> str:
    try:
        from importlib.metadata import version as v

        return v("xtrain")
    except Exception:  # noqa: BLE001  (running from a source tree that was never installed)
        return "unknown"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def machine_info(device=None) -> dict:
    info = dict(python=platform.python_version(), platform=platform.platform(), cpu_count=os.cpu_count(),
                torch=torch.__version__, cuda=torch.version.cuda, threads=torch.get_num_threads(),
                load_avg=os.getloadavg() if hasattr(os, "getloadavg") else None)  # the box may be shared
    if device is not None and torch.device(device).type == "cuda":
        dev = torch.device(device)
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["gpu_count"] = torch.cuda.device_count()
        v = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
        info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else (str(v) if v else None)
        try:
            import pynvml

            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as e:  # NVML missing or failing: record why, never crash a report
            info["driver"] = f"unknown ({type(e).__name__})"
    return info


SCHEMA_VERSION = 1


def header(kind: str, device=None) -> dict:
    return dict(schema_version=SCHEMA_VERSION, kind=kind, machine_info=machine_info(device),
                git_commit=git_commit(), utc=utc_now(), xtrain_version=version())


def atomic_write(path: str, data: str | bytes, mode: int = 0o644) -> None:
    """Write to a temp file in the same folder, then os.replace: readers see the old file or the new one.
    Reports are for reading: mode 0644 (mkstemp alone would leave 0600)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
