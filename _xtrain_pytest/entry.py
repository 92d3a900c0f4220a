"""The pytest11 entry point of xtrain's verify plugin; the plugin itself is verify/_internal/plugin.py.

Why a shim in a namespace package (no __init__.py) outside `verify`: pytest rewrites the asserts of
every module of a distribution that registers a pytest11 plugin and caches the rewritten bytecode next
to the source, which for an installed package is site-packages. pytest marks only top-level modules and
packages that have an __init__.py, so importing this module is plain Python. Before any module of
xtrain-verify is imported it asks pytest's import hook to leave `verify` and `xtrain_core` alone (they raise
GateFailure, never bare asserts, so nothing is lost), and verify/_internal/plugin.py keeps pytest from caching
bytecode next to the gate test modules it collects from the installed package.
"""
import sys

_OURS = ("verify", "xtrain_core", "xtrain_proof")


def _leave_our_packages_alone() -> None:
    for hook in sys.meta_path:
        if type(hook).__name__ != "AssertionRewritingHook":
            continue
        must = getattr(hook, "_must_rewrite", None)
        if isinstance(must, set):
            must.difference_update(_OURS)
        cache = getattr(hook, "_marked_for_rewrite_cache", None)
        if isinstance(cache, dict):
            for name in [n for n in cache if n.split(".")[0] in _OURS]:
                del cache[name]


_leave_our_packages_alone()


def _other_verify() -> None:
    """PyPI's `verify` (an assertion library) owns the same import name: one line and exit status 4 (a usage
    error) instead of an ImportError traceback or a plugin that half works (conflict.py)."""
    from _xtrain_pytest.conflict import check

    msg = check()
    if msg:
        import pytest

        raise pytest.UsageError(msg)


_other_verify()

from verify._internal.plugin import *  # noqa: E402,F401,F403  (the hooks and the verify_adapter fixture)
