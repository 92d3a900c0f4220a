"""verify: prove a trainer's gradient accumulation — anyone's, of any model.

    import verify

    @verify.adapter(data=verify.data.regression(features=8), plain=plain_factory)
    def factory(spec: verify.Spec):          # your model, loss, optimizer, in spec.dtype on spec.device
        return MyTrainer(spec)               # micro_step / grads / optimizer_step / params

    pytest --pyargs verify --verify-trainer mypkg.train:factory -n auto
    python -m verify.selftest --verify-trainer mypkg.train:factory

The public API is `__all__`; every other module and name is internal. Names load on first use, so
`import verify` costs no hypothesis import.
"""
from __future__ import annotations

import importlib


def _other_verify() -> None:
    """PyPI's `verify` 1.1.1 (an assertion library) installs the same import name; mixed with ours, one line
    says so and how to fix it (_xtrain_pytest/conflict.py says how the two interact)."""
    try:
        from _xtrain_pytest.conflict import check
    except ImportError:  # a bare copy of verify/ alone
        return
    msg = check(__path__[0])
    if msg:
        import warnings

        warnings.warn(msg, RuntimeWarning, stacklevel=3)


_other_verify()
__all__ = [
    # the trainer protocol and how to declare an adapter
    "Trainer", "Spec", "Adapter", "adapter", "Expected", "DDP_EXPECTED", "DDP_WORLD1_EXPECTED", "load_adapter",
    "AdapterError", "data",
    # cases and the gates
    "Case", "check_equivalence", "check_bit_exact", "check_distributed", "Gate", "GateFailure", "GateSkipped",
    "GateResult", "check_token_mean", "check_empty_window", "check_overflow",
    # hypothesis strategies
    "cases", "dist_cases",
    # the run report
    "write_report",
    # the collective counter, and a sync mode's exact counts (Adapter(counts=case -> CountRow))
    "Recorder", "Collective", "Windows", "CountRow",
    # the memory probe
    "measure_memory",
    # the fault-injection self-test
    "run_selftest", "OPERATORS",
    # loops the framework owns (HF Trainer, Lightning): the pull-mode driver
    "Pull", "PullError",
    # every knob of a run, from the environment (verify/settings.py)
    "Settings", "SettingError",
    # mesh axes: dp × pp × tp (verify/mesh.py) and their gate
    "Mesh", "check_mesh",
]

_WHERE = {
    "Trainer": "protocol", "Spec": "protocol", "Adapter": "protocol", "adapter": "protocol",
    "Expected": "protocol", "DDP_EXPECTED": "protocol", "DDP_WORLD1_EXPECTED": "protocol", "load_adapter": "protocol",
    "AdapterError": "protocol",
    "Case": "case",
    "check_equivalence": "gates", "check_bit_exact": "gates", "check_distributed": "gates",
    "Gate": "verdict", "GateFailure": "verdict", "GateSkipped": "verdict", "GateResult": "verdict",
    "check_token_mean": "gates", "check_empty_window": "gates", "check_overflow": "gates.overflow",
    "cases": "strategies", "dist_cases": "strategies",
    "write_report": ("report", "write"),
    "Recorder": "comm", "Collective": "comm", "Windows": "comm", "CountRow": "gates.counts",
    "measure_memory": ("memory", "measure"),
    "run_selftest": ("selftest", "run_selftest"), "OPERATORS": ("selftest", "OPERATORS"),
    "Pull": "pull", "PullError": "pull",
    "Settings": "settings", "SettingError": "settings",
    "Mesh": "mesh", "check_mesh": "gates.mesh",
}


def __getattr__(name: str):
    if name == "data":
        return importlib.import_module(".data", __name__)
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'verify' has no attribute {name!r}")
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = getattr(importlib.import_module(f".{module}", __name__), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
