"""The other `verify`: PyPI's `verify` 1.1.1, an assertion library, owns the same import name.

Both distributions install a top-level package `verify`. In one site-packages their files mix: each has
its own `verify/__init__.py`, so whichever was installed last owns `import verify` (theirs: `verify.adapter`
is missing; ours: their API is), and uninstalling either deletes that shared file from under the other.
In different folders of sys.path the first one shadows the other whole. The two cannot be installed
together; the fix is to remove both and reinstall this one.

This module lives outside `verify` on purpose: it must run when `import verify` finds the other package.
It imports nothing of ours and no torch.
"""
from __future__ import annotations

import importlib.util
import os

FIX = ("the import name 'verify' is also installed by PyPI's `verify` (an assertion library), whose files "
       "mix with or shadow xtrain-verify's; fix: pip uninstall -y verify xtrain-verify, then reinstall "
       "xtrain-verify as you installed it")
_THEIRS = "__meta__.py"  # verify 1.1.1's metadata module: no file of ours has that name
_OURS = os.path.join("_internal", "plugin.py")  # a file only ours has


def check(folder: str | None = None) -> str | None:
    """One line saying what is wrong and how to fix it, or None when `verify` (the package in `folder`,
    default: the one `import verify` would load) is ours alone."""
    if folder is None:
        try:
            spec = importlib.util.find_spec("verify")  # finds, does not import
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin:
            return None  # no verify at all: the plain ImportError says enough
        folder = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(folder, _OURS)):
        return f"xtrain-verify: `import verify` loads {folder}, not xtrain-verify's package: {FIX}"
    if os.path.exists(os.path.join(folder, _THEIRS)):
        return f"xtrain-verify: {FIX}"
    return None
