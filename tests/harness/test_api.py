"""verify's public API is exactly `__all__`, every name in it resolves, and importing it is cheap."""
import subprocess
import sys

import verify

PUBLIC = {
    "Trainer", "Spec", "Adapter", "adapter", "Expected", "DDP_EXPECTED", "DDP_WORLD1_EXPECTED", "load_adapter", "AdapterError", "data",
    "Case", "check_equivalence", "check_bit_exact", "check_distributed", "Gate", "GateFailure", "GateSkipped", "GateResult",
    "cases", "dist_cases", "write_report", "Recorder", "Collective", "Windows", "CountRow", "measure_memory",
    "run_selftest", "OPERATORS", "Pull", "PullError",
    "check_token_mean", "check_empty_window", "check_overflow",
    "Settings", "SettingError", "Mesh", "check_mesh",
}


def test_all_is_the_public_api_and_resolves():
    assert set(verify.__all__) == PUBLIC and len(verify.__all__) == len(PUBLIC)
    for name in verify.__all__:
        assert getattr(verify, name) is not None, name
    assert set(dir(verify)) >= PUBLIC
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        verify.nope  # noqa: B018


def test_import_verify_loads_neither_hypothesis_nor_the_harness():
    code = "import sys, verify; print(sorted(m for m in ('hypothesis', 'verify.gates', 'verify.strategies') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_plugin_is_registered_on_the_pytest11_entry_point():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="pytest11") if ep.value == "_xtrain_pytest.entry"]
    assert eps and eps[0].name == "xtrain-verify", eps
