"""PYTEST_DONT_REWRITE (no rewritten bytecode is cached next to an installed package)

The single-process gates on the adapter under proof (--verify-trainer; default xtrain's trainer):
big-batch equivalence over drawn (N, B, K, seeds, options), and accum_steps=1 bit-identical to the
adapter's declared plain step. Each passed example goes into the run report.
"""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import report
from ._gpulock import gpu_shared  # noqa: F401  (fixture: GPU gates share the GPU, memory probes do not)
from .gates import check_bit_exact, check_equivalence
from .strategies import cases

pytestmark = [pytest.mark.verify_gate, pytest.mark.usefixtures("gpu_shared")]


@settings(deadline=None)
@given(data=st.data())
def test_accumulation_equals_big_batch(verify_adapter, data):
    case = data.draw(cases(verify_adapter), label="case")
    report.record(check_equivalence(verify_adapter, case))


def test_accum1_bit_identical_to_plain(verify_adapter):
    if verify_adapter.plain is None:
        reason = (f"{verify_adapter.name} declares no plain (no-accumulation) step: declare "
                  f"@verify.adapter(plain=...) to prove accum_steps=1 is that step bit for bit")
        report.skip("bit_exact", reason)
        pytest.skip(reason)

    @settings(deadline=None)
    @given(data=st.data())
    def bit_exact(data):
        case = data.draw(cases(verify_adapter, max_accum=1, max_micro_batch=8), label="case")
        report.record(check_bit_exact(verify_adapter, case))

    bit_exact()
