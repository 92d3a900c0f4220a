"""xtrain: a minimal PyTorch trainer core that does gradient accumulation right.

Names load on first use, so `import xtrain_core` (and `python -m xtrain_core.train --help`) imports no torch:
the CLI can still set the OpenMP environment before torch loads its OpenMP runtime.
"""
from __future__ import annotations

import importlib

__all__ = [
    "PRESETS", "ModelConfig", "OptimConfig", "TrainConfig", "TokenStream", "DocStream", "FullWindows", "split_micro",
    "GPT", "build_model", "AccumTrainer", "make_optimizer", "plain_step",
]
_WHERE = {"PRESETS": "config", "ModelConfig": "config", "OptimConfig": "config", "TrainConfig": "config",
          "TokenStream": "data", "DocStream": "data", "FullWindows": "data", "split_micro": "data",
          "GPT": "model", "build_model": "model", "AccumTrainer": "trainer", "make_optimizer": "trainer",
          "plain_step": "trainer"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'xtrain_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
