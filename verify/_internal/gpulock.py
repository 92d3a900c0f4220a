"""Keeps memory tests off a GPU the plugin's gate tests are using, also under pytest-xdist.

NVML's "device memory used" is device-wide, so every test marked `gpu` holds a SHARED lock on one lock file
and every test marked `gpu` and `memory` an EXCLUSIVE one, across xdist workers and concurrent sessions of the
same user. The plugin's gate tests take the shared hold through `gpu_shared`; the project's tests through an
autouse fixture in tests/conftest.py. Path: $XTRAIN_GPU_LOCK, else <tmp>/xtrain-gpu-<uid>.lock. Convention:
a test that touches CUDA is marked `gpu`.

Design: docs/design/memory.md.
"""
from __future__ import annotations

from contextlib import contextmanager

import pytest

from verify._internal.settings import current


def lock_path() -> str:
    return current().gpu_lock


@contextmanager
def gpu_lock(exclusive: bool):
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock (and no xdist GPU runs to protect)
        yield
        return
    with open(lock_path(), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture
def gpu_shared():
    """For gate tests: a shared hold on the GPU while they run on CUDA (memory probes wait for none)."""
    if current().device != "cuda":
        yield
        return
    with gpu_lock(exclusive=False):
        yield
