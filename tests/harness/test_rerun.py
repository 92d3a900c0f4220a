"""verify/_internal/gates/rerun.py: a failing case re-run with one knob changed names its class — one representative of
each planted bug class (planted/registry.py, tests/helpers/), asserted on this project's own hint."""
import pytest
from tests.helpers.tiers import dev_first, imports_framework

from planted.registry import BY_NAME
from verify._internal.cases.case import Case
from verify._internal.gates import GateFailure
from verify._internal.gates.distributed import check_distributed
from verify._internal.gates.mesh import check_mesh
from verify._internal.gates.rerun import diagnose, diagnosed
from verify._internal.gates.single import check_equivalence
from verify._internal.hints import hint
from verify._internal.protocol import load_adapter

pytestmark = pytest.mark.distributed

SINGLE = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2)
DIST = SINGLE.replace(world=2)


def _failure(check, adapter, case) -> GateFailure:
    with pytest.raises(GateFailure) as e:
        check(adapter, case)
    return e.value


def _planted(name):
    b = BY_NAME[name]
    check = check_mesh if b.case.mesh is not None else check_distributed if b.case.world > 1 else check_equivalence
    return b.load(), _failure(check, b.load(), b.case)


def _helper(name):
    return load_adapter(f"tests.helpers.rerun_adapters:{name}")


# (planted bug or helper, check, case, what the diagnosis must say)
CLASSES = {
    "missing 1/N": ("missing_1_over_N", None, None, ("N=1 passes", "a missing 1/N")),
    "1/N twice": ("over_n_twice", check_equivalence, SINGLE, ("N=1 passes", "1/N applied twice")),
    "no /W": ("no_over_w", check_distributed, DIST, ("W=1 passes", "a missing 1/W")),
    "/W twice": ("divide_by_world_twice", None, None, ("W=1 passes", "1/W applied twice")),
    "per-micro-step scheduler": ("scheduler_step_every_micro", None, None,
                                 ("the update does not", "stepped inside the micro-step loop")),
    "per-micro-step optimizer": ("optimizer_step_every_micro", None, None,
                                 ("N=1 passes", "an optimizer step inside the micro-step loop")),
    "per-rank scheduler": ("per_rank_undeclared", None, None, ("advances once per rank", "scheduler_per_rank=True")),
    "clipping per micro-step": ("clip_per_micro", check_equivalence, SINGLE.replace(options=0.05),
                                ("unclipped passes", "clip once")),
    "pipeline scale_grads": ("scale_grads_ema", None, None, ("scale_grads=True",)),
    "tp − 1": ("loss_times_tp", None, None, ("tp − 1",)),
}


# The dev loop re-runs one single-process class and one data-parallel one; CI every class (docs/performance.md,
# "Test tiers").
DEV = ("1/N twice", "no /W")


@pytest.mark.parametrize("cls", dev_first([*DEV, *sorted(set(CLASSES) - set(DEV))], dev=len(DEV)))
def test_each_bug_class_is_diagnosed_by_re_running(cls):
    name, check, case, says = CLASSES[cls]
    adapter, failure = _planted(name) if check is None else (_helper(name), _failure(check, _helper(name), case))
    line, seen = diagnose(adapter, failure)
    assert line is not None and all(s in line for s in says), (cls, line)
    assert "dropout" not in line, line
    if cls != "per-micro-step optimizer":  # the pattern is right for it: an optimizer step acts per micro-batch
        assert "something acts per micro-batch" not in line, line


@imports_framework
def test_an_undeclared_accelerate_scheduler_gets_the_per_rank_diagnosis_not_the_clipping_pattern():
    adapter = _helper("accelerate_undeclared")
    failure = _failure(check_distributed, adapter, Case(accum_steps=2, micro_batch=2, steps=3, world=2, seed=2,
                                                        data_seed=3))
    assert "something acts per micro-batch" in (hint(failure) or "")  # the pattern alone: the wrong lead
    assert "scheduler_per_rank=True" in hint(diagnosed(adapter, failure))


def test_nondeterminism_is_the_gates_own_diagnosis():
    adapter = load_adapter("planted.calib_adapters:dropout")
    failure = _failure(check_equivalence, adapter, SINGLE)
    assert diagnose(adapter, failure) == (None, {}) and "deterministic" in hint(diagnosed(adapter, failure))


@pytest.mark.parametrize("world", [1, 2])
def test_a_trainer_normalising_in_its_step_is_named_with_its_factor_and_passes_declared(world):
    case = DIST.replace(world=world)
    if world == 2:
        failure = _failure(check_distributed, _helper("normalise_in_step"), case)
        line = hint(diagnosed(_helper("normalise_in_step"), failure))
        assert "normalises inside optimizer_step()" in line and "0.5×" in line and 'grads_from="optimizer"' in line
    else:
        check_distributed(_helper("normalise_in_step"), case)  # one rank: grads() and the step agree (no ÷ W)
    check_distributed(_helper("normalise_in_step_declared"), case)


def test_a_trainer_normalising_in_its_step_has_its_reported_metrics_judged():
    """grads_from="optimizer" wraps the trainer (atstep.OptimizerGrads): its metrics() must reach the metrics gate,
    which once read none and failed an honest trainer ("metrics() has no 'loss'"; found by the zoo, t7)."""
    from verify._internal.gates.metrics import check_metrics

    case = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, lengths=(5, 2, 0, 4, 5, 1) * 2)
    check_metrics(_helper("normalise_in_step_reporting"), case)
    failure = _failure(check_metrics, _helper("reports_last_micro_tokens"), case)
    assert failure.gate.value == "reported metrics" and "tokens" in str(failure).splitlines()[0], failure


def test_a_mesh_failure_shrunk_to_n1_gets_its_mesh_hint_not_nondeterminism():
    b = BY_NAME["loss_times_tp"]  # where hypothesis' shrinking lands: N=1, dp=1
    case = b.case.replace(accum_steps=1, micro_batch=b.case.micro_batch * b.case.accum_steps)
    failure = _failure(check_mesh, b.load(), case)
    line = hint(diagnosed(b.load(), failure))
    assert "tp − 1" in line and "dropout" not in line, line


def test_a_bad_grads_from_or_unclipped_is_one_line_naming_the_field():
    import verify
    from verify._internal.protocol import AdapterError

    for kw, says in ((dict(grads_from="step"), "grads_from must be one of 'grads', 'optimizer', got 'step'"),
                     (dict(unclipped=0.5), "Adapter.unclipped must be callable")):
        with pytest.raises(AdapterError) as e:
            verify.adapter(data=verify.data.regression(features=2), **kw)(_helper("over_n_twice").factory)
        assert says in str(e.value) and "\n" not in str(e.value)


def test_a_token_mean_failure_of_a_trainer_normalising_in_its_step_names_the_count():
    from verify._internal.gates import check_normaliser

    case = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2,
                lengths=(4, 1, 2, 1, 3, 1, 2, 3, 4, 4, 1, 2))  # window A: 12 valid targets
    failure = _failure(check_normaliser, _helper("normalise_in_step"), case)
    assert "divide by the window's count of valid targets" in hint(failure)  # the raiser's lead, before the re-run
    line = hint(diagnosed(_helper("normalise_in_step"), failure))
    assert "grads() is 12× the gradient the optimizer steps with" in line and 'grads_from="optimizer"' in line, line
    check_normaliser(_helper("normalise_in_step_declared"), case)
    split = Case(accum_steps=2, micro_batch=2, steps=1, seed=1, data_seed=2, lengths=(4, 1, 3, 2))
    from verify._internal.gates.windows import check_split_invariance
    check_split_invariance(_helper("normalise_in_step_declared"), split, max_world=2)
