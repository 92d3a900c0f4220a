"""verify: prove a trainer's gradient accumulation — anyone's, of any model.

    @verify.adapter(data=verify.data.regression(features=8), plain=plain_factory)
    def factory(spec: verify.Spec):          # your model, loss, optimizer, in spec.dtype on spec.device
        return MyTrainer(spec)               # micro_step / grads / optimizer_step / params
    pytest --pyargs verify --verify-trainer mypkg.train:factory -n auto
    python -m verify.selftest --verify-trainer mypkg.train:factory

The public API is `__all__` (names load on first use: `import verify` costs no hypothesis import); the
rest is internal. Guide: docs/verify-your-trainer.md; design: docs/design/README.md.
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
    # the protocol your trainer implements, and how to declare its adapter
    "Trainer", "Spec", "Adapter", "adapter", "AdapterError", "data", "hf",
    # its declarations, one per concern (docs/verify-your-trainer.md, "Declarations")
    "Batches", "Distributed", "Numerics", "MemoryModel", "Metrics", "Objective", "Parity", "Threshold",
    # what a sync mode may communicate: expected collectives, a mode's exact counts, a mesh's axes
    "Expected", "DDP_EXPECTED", "DDP_WORLD1_EXPECTED", "CountRow", "Windows", "Mesh",
    # a mesh case's DeviceMesh, built once per process (dims "dp", "pp", "cp" where > 1, "tp")
    "device_mesh",
    # loops the framework owns (HF Trainer, Lightning): the pull-mode driver
    "Pull", "PullError",
    # one gate on one case, and its verdict, as a test or a script sees it
    "check", "Case", "Gate", "GateFailure", "GateSkipped",
    # every knob of a run (the knob table: docs/verify-your-trainer.md)
    "Settings",
    # the studies beside the gates, and the header every report carries
    "run_selftest", "measure_memory", "report_header", "atomic_write",
]

# name -> (module, attribute); modules are absolute so a reader finds them with one search
_WHERE = {
    "Trainer": ("verify._internal.protocol", "Trainer"), "Spec": ("verify._internal.protocol", "Spec"),
    "Adapter": ("verify._internal.protocol", "Adapter"), "adapter": ("verify._internal.protocol", "adapter"),
    "AdapterError": ("verify._internal.protocol", "AdapterError"), "Metrics": ("verify._internal.metrics", "Metrics"),
    "Objective": ("verify._internal.objective", "Objective"), "Parity": ("verify._internal.declare", "Parity"),
    "Batches": ("verify._internal.declare", "Batches"), "Distributed": ("verify._internal.declare", "Distributed"),
    "Numerics": ("verify._internal.declare", "Numerics"), "MemoryModel": ("verify._internal.declare", "MemoryModel"),
    "Threshold": ("verify._internal.declare", "Threshold"),
    "Expected": ("verify._internal.protocol", "Expected"), "DDP_EXPECTED": ("verify._internal.protocol", "DDP_EXPECTED"),
    "DDP_WORLD1_EXPECTED": ("verify._internal.protocol", "DDP_WORLD1_EXPECTED"),
    "CountRow": ("verify._internal.gates.counts", "CountRow"), "Windows": ("verify._internal.ranks.comm", "Windows"),
    "Mesh": ("verify._internal.ranks.mesh", "Mesh"), "device_mesh": ("verify._internal.ranks.mesh", "device_mesh"),
    "Pull": ("verify._internal.cases.pull", "Pull"), "PullError": ("verify._internal.cases.pull", "PullError"),
    "check": ("verify._internal.gates.table", "check"), "Case": ("verify._internal.cases.case", "Case"),
    "GateSkipped": ("verify._internal.verdict", "GateSkipped"),
    "Gate": ("verify._internal.verdict", "Gate"), "GateFailure": ("verify._internal.verdict", "GateFailure"),
    "Settings": ("verify._internal.settings", "Settings"),
    "run_selftest": ("verify.selftest", "run_selftest"), "measure_memory": ("verify.memory", "measure"),
    "report_header": ("verify._internal.header", "header"), "atomic_write": ("verify._internal.header", "atomic_write"),
}


def __getattr__(name: str):
    if name in ("data", "hf", "mesh"):  # mesh: the deprecated path of device_mesh and Mesh (it warns)
        return importlib.import_module(f".{name}", __name__)
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'verify' has no attribute {name!r}")
    module, attr = where
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
