"""verify/_internal/gates/evidence.py: the leads measured on the trainer itself, named in EVERY failure of a trainer
that has the bug (issue 42, items 7 and 9) — per gate that fails, this project's own hint — and never on the
correct trainer beside it."""
import os
import re
import subprocess
import sys

import pytest
from tests.helpers.tiers import imports_framework

from planted import calib_adapters as calib
from planted import hint_adapters as ha
from verify._internal.cases.case import Case
from verify._internal.gates import GateFailure, check_normaliser
from verify._internal.gates.distributed import check_distributed
from verify._internal.gates.evidence import built_wrong, micro_means, per_rank_schedule
from verify._internal.gates.rerun import diagnosed
from verify._internal.gates.single import check_equivalence
from verify._internal.gates.windows import check_split_invariance
from verify._internal.hints import hint
from verify._internal.verdict import Gate

PADDED = (2, 4, 0, 0, 0, 0, 4, 5, 5, 5, 5, 5)  # window 0: one micro-batch with targets; window 1: 9, 10, 10 at N=3
CASE = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, lengths=PADDED)
ONE_HELD = Case(accum_steps=2, micro_batch=3, steps=1, seed=1, data_seed=2, lengths=PADDED[:6])  # one micro-batch
SCHEDULER = ("advances once per rank", "scheduler_per_rank=True")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fails(check, adapter, case, **kw) -> GateFailure:
    with pytest.raises(GateFailure) as e:
        check(adapter, case, **kw)
    return e.value


def _hints(adapter, runs) -> dict:
    """{gate: (the pattern's hint alone, the hint after the re-runs)} of each (check, case, kwargs) that fails."""
    out = {}
    for check, case, kw in runs:
        f = _fails(check, adapter, case, **kw)
        out[f.gate] = (hint(f) or "", hint(diagnosed(adapter, f)) or "")
    return out


# -- item 9: the per-micro-batch count named first, by what the re-runs show -------------------------------

def test_a_per_micro_batch_token_mean_is_named_first_in_every_failure_not_1_over_n_twice():
    got = _hints(ha.per_micro_token_mean, [(check_equivalence, CASE, {}), (check_split_invariance, ONE_HELD, {}),
                                           (check_normaliser, CASE, {})])
    assert set(got) == {Gate.EQUIVALENCE, Gate.SPLIT_INVARIANCE, Gate.NORMALISER}
    assert "1/N applied twice" in got[Gate.EQUIVALENCE][0]  # the error's pattern alone: the wrong lead first
    for gate, (_, line) in got.items():
        assert "1/N applied twice" not in line, (gate, line)
        assert "each micro-batch divided by its own valid count" in line or "own token means" in line, (gate, line)
    # where micro-batches hold unequal counts, measured: the gradient is the mean of the micro-batches' own means
    assert "the mean of its 3 micro-batches' own token means (valid targets per micro-batch [9, 10, 10])" in \
        got[Gate.EQUIVALENCE][1] and "unpadded passes" in got[Gate.EQUIVALENCE][1]
    assert "own token means" in got[Gate.NORMALISER][1]
    # one micro-batch holds every target there: only the unpadded re-run can tell, and it does
    assert got[Gate.SPLIT_INVARIANCE][1].startswith("re-run N=1 passes, unpadded passes: unpadded, every micro-batch")
    for check, case in ((check_equivalence, CASE), (check_split_invariance, ONE_HELD), (check_normaliser, CASE)):
        check(ha.token_mean, case)  # the correct trainer passes the same cases


def test_1_over_n_twice_on_a_padded_token_mean_keeps_its_factor():
    line = hint(diagnosed(ha.over_n_twice, _fails(check_equivalence, ha.over_n_twice, CASE)))
    assert "1/N applied twice" in line and "unpadded fails" in line and "own" not in line, line
    assert micro_means(ha.over_n_twice, CASE, False) is None and micro_means(ha.token_mean, CASE, False) is None


@pytest.mark.distributed
def test_a_per_micro_batch_token_mean_on_ranks_is_named_too():
    case = Case(accum_steps=3, micro_batch=1, steps=2, world=2, seed=1, data_seed=2, lengths=PADDED)
    line = hint(diagnosed(ha.per_micro_token_mean_dp, _fails(check_distributed, ha.per_micro_token_mean_dp, case)))
    assert "own token means" in line and "unpadded passes" in line, line


@pytest.mark.distributed
def test_a_per_rank_token_mean_is_named_per_rank_first():
    from planted.registry import BY_NAME

    b = BY_NAME["per_rank_mean"]  # each rank ÷ its own count, the ranks averaged: right at W=1 and unpadded
    f = _fails(lambda a, c: check_split_invariance(a, c, max_world=b.args[0]), b.load(), b.case)
    line = hint(diagnosed(b.load(), f))
    assert "W=1 passes" in line and "unpadded passes" in line, line
    assert "where the padding falls — each rank divided by its own valid count (a per-rank token mean)" in line, line


# -- item 9: a wrong dtype and a wrong seed, each its own diagnosis -------------------------------------------

def test_a_model_not_built_in_spec_dtype_is_named_in_every_failure():
    unpadded = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2)
    # the normaliser passes it: its one float32 symptom is the shift's gradient, zero in exact arithmetic and judged
    # against the whole gradient (tolerance.param_scale); the float64 parameters AdamW moved by that noise still fail
    assert check_normaliser(ha.wrong_dtype, CASE).gate == Gate.NORMALISER
    got = _hints(ha.wrong_dtype, [(check_equivalence, unpadded, {})])
    assert set(got) == {Gate.EQUIVALENCE}
    for gate, (_, line) in got.items():
        assert line.startswith("re-run: built from a float64 Spec, the trainer holds 4 of 4 trainable parameters "
                               "in float32"), line
        assert "model.to(spec.device, spec.dtype)" in line and "scheduler" not in line, line
    assert built_wrong(ha.shifted, unpadded, False) is None  # the same model in Spec.dtype: no such lead


def test_a_model_not_seeded_from_spec_seed_is_named_in_every_failure_not_dropout():
    got = _hints(ha.unseeded, [(check_equivalence, CASE, {}), (check_normaliser, CASE, {})])
    assert set(got) == {Gate.DETERMINISM, Gate.NORMALISER}
    assert "dropout" in got[Gate.DETERMINISM][0]  # the raiser's own lead, before the re-run
    for gate, (_, line) in got.items():
        assert "start from different parameters ('body.0.weight'" in line and "not seeded from Spec.seed" in line
        assert "dropout" not in line, line
    assert built_wrong(calib.dropout, CASE, False) is None  # dropout: seeded, its init the same every build
    assert built_wrong(ha.token_mean, CASE, False) is None


# -- item 7: the per-rank scheduler named in every failure of an undeclared Accelerate trainer ---------------

def _accelerate(name):
    pytest.importorskip("accelerate")
    from planted import accelerate_adapters

    return getattr(accelerate_adapters, name)


def _accelerate_runs(name, W):
    """Every gate that fails for the undeclared trainer at world W: the data-parallel gate (its numbers at K=2, its
    reported LR at K=1 where the recipe declares metrics), and split invariance for the token-weighted one."""
    if name == "fixed_undeclared":
        case = Case(accum_steps=2, micro_batch=1, steps=2, world=W, seed=1, data_seed=2)
        return [(check_distributed, case, {}), (check_distributed, case.replace(steps=1), {})]
    rows = (3, 0, 5, 2, 4, 1, 5, 2) if W == 2 else (3, 0, 5, 2, 4, 1)  # E = 4 (W=2 splits) or 3 (only W=3 splits)
    dp = Case(accum_steps=2, micro_batch=1, steps=2, world=W, seed=1, data_seed=2, lengths=(rows * 3)[:4 * W])
    split = Case(accum_steps=len(rows) // 2, micro_batch=1, steps=2, seed=1, data_seed=2, lengths=rows)
    return [(check_distributed, dp, {}), (check_split_invariance, split, {"max_world": W})]


@imports_framework
@pytest.mark.distributed
@pytest.mark.parametrize("W", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["fixed_undeclared", "tokens_undeclared"])
def test_the_per_rank_scheduler_is_named_in_every_failure_of_an_undeclared_accelerate_trainer(name, W):
    adapter = _accelerate(name)
    runs = _accelerate_runs(name, W)
    got = {}
    for check, case, kw in runs:
        f = _fails(check, adapter, case, **kw)
        assert f.case.world == W, f  # the failing split is at W (no W=1 split fails)
        got[f.gate] = hint(diagnosed(adapter, f)) or ""
    want = {Gate.DP_EQUIVALENCE, Gate.REPORTED_METRICS if name == "fixed_undeclared" else Gate.SPLIT_INVARIANCE}
    assert set(got) == want, got
    for gate, line in got.items():
        assert all(s in line for s in SCHEDULER) and f"{W}× per optimizer step" in line, (gate, line)
        assert f"the reference's at step {W}·k:" in line and "inside the micro-step loop" not in line, line
    if name == "tokens_undeclared":  # the declared trainer passes the same cases
        for check, case, kw in runs:
            check(_accelerate("tokens_declared"), case, **kw)


@pytest.mark.distributed
def test_the_schedule_lead_reads_what_the_reference_does():
    case = Case(accum_steps=2, micro_batch=2, steps=3, world=2, seed=2, data_seed=3)
    assert per_rank_schedule(calib.per_rank_sched, case) is None  # declared and emulated: the reference agrees
    line = per_rank_schedule(calib.per_rank_unemulated, case)  # declared, its reference ignoring schedule_world
    assert "you declare scheduler_per_rank=True, yet in the one-process reference" in line, line
    assert per_rank_schedule(calib.fp32_constant_dp, case) is None  # a warm-up stepped once per step, any world


@imports_framework
@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler")  # the order Accelerate's examples show
def test_a_scheduler_stepped_in_the_micro_steps_inside_accumulate_is_named_too():
    """Accelerate's examples step the scheduler inside accumulate() every micro-step: it advances on the window's
    last one, before the optimizer steps, so the ranks' LR at step k is the reference's at step 2·k + 1."""
    adapter = _accelerate("micro_scheduler_undeclared")
    check_equivalence(adapter, Case(accum_steps=3, micro_batch=2, steps=3, seed=1, data_seed=2))  # alone: right
    f = _fails(check_distributed, adapter, Case(accum_steps=2, micro_batch=1, steps=2, world=2, seed=1, data_seed=2))
    line = hint(diagnosed(adapter, f))
    assert "the reference's at step 2·k + 1:" in line and all(s in line for s in SCHEDULER), line


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["fixed_undeclared", "tokens_undeclared"])
def test_through_the_plugin_every_failing_test_names_the_per_rank_scheduler(tmp_path, name):
    """The user's view at W=2 (dev profile, the data-parallel and split gates): each failing test's hint line."""
    _accelerate(name)
    env = {**{k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER", "COLUMNS")},
           "PYTHONPATH": ROOT, "HYPOTHESIS_PROFILE": "dev", "OMP_NUM_THREADS": "1", "XTRAIN_DIST_MAX_WORLD": "2",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "verify", "-p", "no:cacheprovider", "-q", "-p",
                        "no:xdist", "--verify-trainer", f"planted.accelerate_adapters:{name}", "-k",
                        "data_parallel or bytes_per_step or split_invariance"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 1, r.stdout[-3000:]
    parts = re.split(r"^_{3,} (test_\w+) _{3,}$", r.stdout.split("short test summary info")[0], flags=re.M)
    failed = dict(zip(parts[1::2], parts[2::2]))
    assert {"test_data_parallel_boundary_only_and_equivalent", "test_bytes_per_step_independent_of_N"} <= set(failed)
    assert len(failed) == r.stdout.count("\nFAILED "), r.stdout[-3000:]
    for test, text in failed.items():
        hints = [ln for ln in text.splitlines() if ln.startswith("hint: ")]
        assert hints and all(all(s in h for s in SCHEDULER) and "2× per optimizer step" in h for h in hints), \
            (test, text)
