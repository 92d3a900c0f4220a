"""The default trainer is named once (pyproject.toml's entry point verify.trainers:default) and found installed or
from a bare checkout; with neither, a run that names no trainer is refused in one line."""
import importlib.metadata

import pytest

from verify._internal import trainers
from verify._internal.settings import SettingError

XTRAIN = "xtrain_proof.adapters:adapter"


def test_the_installed_default_is_xtrains():
    assert trainers.default_trainer() == XTRAIN and trainers.trainer_ref(None) == XTRAIN
    assert trainers.trainer_ref("mypkg.train:factory") == "mypkg.train:factory"  # a given trainer wins


def test_a_bare_checkout_reads_its_pyproject(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])  # nothing installed
    assert trainers.default_trainer() == XTRAIN


def test_without_a_default_a_run_must_name_its_trainer(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    monkeypatch.setattr(trainers, "checkout_pyproject", lambda: str(tmp_path / "pyproject.toml"))  # none there
    assert trainers.default_trainer() is None
    with pytest.raises(SettingError) as e:
        trainers.trainer_ref(None, "--verify-trainer")
    assert str(e.value).count("\n") == 0 and str(e.value).endswith("pass --verify-trainer MODULE:FACTORY")
