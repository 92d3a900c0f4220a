"""Which trainer a run proves: --verify-trainer, else the configured default — the `default` entry point of
TRAINERS_GROUP in the installed metadata, or in a bare checkout's pyproject.toml (docs/design/layout.md)."""
from __future__ import annotations

import os

from verify._internal.settings import SettingError


TRAINERS_GROUP = "verify.trainers"
"""The entry-point group naming trainers by a short name; its `default` is the trainer a run proves when none is
given (a distribution declares it in its metadata, e.g. pyproject's [project.entry-points."verify.trainers"])."""


def checkout_pyproject() -> str:
    """Where a checkout keeps its pyproject.toml: beside the `verify` package this module belongs to."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "pyproject.toml")


def default_trainer() -> str | None:
    """The configured default trainer's 'MODULE:FACTORY': the installed `default` of TRAINERS_GROUP, else (a bare
    checkout on PYTHONPATH, e.g. copied to a GPU box without pip install) the one its pyproject.toml declares; None."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=TRAINERS_GROUP, name="default"):
        return ep.value
    try:
        import tomllib

        with open(checkout_pyproject(), "rb") as f:
            declared = tomllib.load(f).get("project", {}).get("entry-points", {}).get(TRAINERS_GROUP, {})
    except (OSError, ValueError, ImportError):
        return None
    return declared.get("default")


def trainer_ref(given: str | None, option: str = "--verify-trainer") -> str:
    """`given`, else the configured default trainer; SettingError (one line) when there is neither."""
    ref = given or default_trainer()
    if not ref:
        raise SettingError(f"{option}: no trainer given and no default trainer is installed (entry point "
                           f"'default' of {TRAINERS_GROUP}); pass {option} MODULE:FACTORY")
    return ref
