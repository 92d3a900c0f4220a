"""The harness's command-line plumbing: the shared one-line errors, integer types, progress bar and device
checks (_xtrain_cli, which xtrain's trainer uses too), and how a pytest run of the gates loads the plugin."""
from __future__ import annotations

from _xtrain_cli import (PROG, Parser, Progress, UsageError, available_memory, check_fits, fail, int_at_least,
                         nonneg_int, positive_int, resolve_device, writable_dir)

__all__ = ["UsageError", "Parser", "PROG", "fail", "int_at_least", "positive_int", "nonneg_int", "Progress",
           "writable_dir", "available_memory", "check_fits", "resolve_device", "plugin_args"]


PLUGIN = "_xtrain_pytest.entry"  # the pytest11 entry point's module (pyproject.toml)


def plugin_args(argv=()) -> list[str]:
    """`-p _xtrain_pytest.entry` for a pytest run of the gates when the pytest11 entry point is not registered (a
    bare tree on PYTHONPATH, e.g. a checkout copied to a GPU box without `pip install`) and `argv` does not load it
    already; an installed xtrain loads it by itself, and loading it twice would be an error."""
    from importlib.metadata import entry_points

    registered = any(ep.value == PLUGIN for ep in entry_points(group="pytest11"))
    return [] if registered or PLUGIN in argv else ["-p", PLUGIN]
