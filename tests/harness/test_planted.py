"""The one registry of planted bugs (planted/registry.py): every entry is rejected by its gate, on
its case, with its message; every planted adapter of planted/ is in it (or a named control); and
docs/design/self-test.md carries its table as the registry draws it."""
import re
from pathlib import Path

import pytest

from planted import broken, broken_dist, broken_lowprec, broken_mesh, broken_numerics, broken_overflow, broken_tokens
from planted import broken_mesh_metrics, broken_tp, ddp_modes, moe_adapters, packed_adapters, registry as planted
from planted import cp_adapters, parity_adapters, short_adapters, uneven_adapters, zero_adapters, zero_grad_adapters
from planted import broken_amp_metrics  # issue 42 item 3
from planted import atstep_adapters  # issue 42, the zoo's grads_from="optimizer" classes
from verify._internal.gates import GateFailure
from verify._internal.gates.worlds import max_world
from verify._internal.gates.mesh import check_mesh
from verify._internal.gates.table import TABLE
from verify._internal.protocol import Adapter
from verify._internal.verdict import Gate

ROOT = Path(__file__).resolve().parents[2]
RUN = {g: row.check for g, row in TABLE.items()}  # each gate's check, from the gate table
# harmless by design, and checked to pass where they are tested; compiled_runs_eager fails the trainer's own
# guard (DistJobError), not a gate
CONTROLS = {id(a) for a in (broken.scaled_by_one, broken_dist.fsdp2_switch_after_forward,
                            ddp_modes.compiled_runs_eager)}


# The dev loop (-m "not slow") runs one bug per gate, its first in the registry: each gate's check is seen to reject
# once; CI runs all of them (docs/performance.md, "Test tiers").
DEV = {next(b.name for b in planted.PLANTED if b.gate == g and not b.slow)
       for g in {b.gate for b in planted.PLANTED if not b.slow}}


def _param(b):
    marks = [pytest.mark.slow] if b.slow or b.name not in DEV else []
    # the split gates take their world as an argument: (max_world,), (world,)
    ranks = max(b.case.ranks, b.args[0] if b.gate in (Gate.SPLIT_INVARIANCE, Gate.MESH_SPLIT_INVARIANCE) else 1)
    if ranks > 1 or (isinstance(b.adapter, Adapter) and b.adapter.process_group):
        marks.append(pytest.mark.distributed)
    if ranks > max_world():
        marks.append(pytest.mark.skip(reason=f"needs world ≥ {ranks} (XTRAIN_DIST_MAX_WORLD / GPUs)"))
    return pytest.param(b, id=b.name, marks=marks)


@pytest.mark.parametrize("bug", [_param(b) for b in planted.PLANTED if b.gate in RUN])
def test_its_gate_rejects_it(bug, settings_with):
    if bug.needs:
        pytest.importorskip(bug.needs)
    settings_with(**dict(bug.knobs))  # the Settings the gate runs under (pools are keyed by them)
    adapter = bug.load()  # tests/helpers/ ones by reference
    with pytest.raises(GateFailure) as e:
        (check_mesh if bug.case.mesh is not None else RUN[bug.gate])(adapter, bug.case, *bug.args)  # one mesh gate
    msg = str(e.value)
    assert e.value.gate is bug.gate and msg.startswith(f"[{bug.gate}]"), msg
    assert re.search(bug.pattern, msg), msg
    if e.value.error is not None and e.value.bound is not None:  # a numeric verdict: the error left its bound
        assert not e.value.error < e.value.bound, msg  # (NaN: not within it either)


def test_every_gate_of_the_registry_is_driven():
    # tests/test_memory.py runs the memory CLI on its bugs, tests/examples/test_launcher.py torchrun on the launcher's
    assert {b.gate for b in planted.PLANTED} - set(RUN) == {"memory", "launcher"}
    assert all(b.case is not None for b in planted.PLANTED if b.gate in RUN)


def test_every_planted_adapter_is_registered():
    registered = {id(b.adapter) for b in planted.PLANTED}
    modules = (broken, broken_dist, broken_lowprec, broken_mesh, broken_mesh_metrics, broken_numerics, broken_overflow,
               broken_tokens, broken_tp, cp_adapters, ddp_modes, moe_adapters, packed_adapters, parity_adapters,
               short_adapters, uneven_adapters, broken_amp_metrics, zero_adapters, zero_grad_adapters, atstep_adapters)
    missing = [f"{m.__name__}.{k}" for m in modules for k, a in vars(m).items()
               if isinstance(a, Adapter) and a.name.startswith("broken") and id(a) not in registered
               and id(a) not in CONTROLS]
    assert not missing, f"planted bugs outside planted/registry.py: {missing}"


def test_the_design_doc_carries_the_registry_table():
    doc = (ROOT / "docs" / "design" / "self-test.md").read_text()
    assert planted.table() in doc, "docs/design/self-test.md: paste planted.registry.table() in place of the old table"


# The self-test's operators that inject a bug the registry also plants (the same fault, applied by a wrapper to
# any trainer instead of planted in xtrain's): one bug, one name, in both tables.
SAME_BUG = ("optimizer_step_every_micro", "zero_grad_in_micro_loop", "divide_by_world_twice", "per_micro_mean",
            "count_from_first_micro", "per_rank_mean", "all_positions", "sequences", "skip_decided_on_one_rank",
            "equal_rank_weights")


def test_a_bug_in_both_the_registry_and_the_selftest_has_one_name():
    from verify.selftest.operators import OPERATORS

    assert [n for n in SAME_BUG if n not in OPERATORS or n not in planted.BY_NAME] == []
