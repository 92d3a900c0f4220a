"""Every profile starts with its hard corners (verify._internal.cases.corners.corners): each gate test draws its known-hard
cases first, as explicit examples (never shrunk), then random ones within the same budget. Under the dev profile
the plugin's gate tests reject the bugs only a corner shows — found_inf broadcast from rank 0 (the overflow on the
last rank; float data and token data) and a pipeline schedule's scale_grads=True under outer accumulation (chunks
≥ 2 and outer ≥ 2) — while the same loops done right pass."""
import os
import subprocess
import sys

import pytest

from planted import broken_mesh, broken_overflow
from xtrain_proof import adapters as xtrain
from verify import Gate
from verify._internal.gates.table import TABLE, gate_budget, random_budget
from verify._internal.cases.corners import LONG_N, corners

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_overflow_corner_is_the_boundary_micro_step_on_the_last_rank():
    (case, micro, rank), (small, micro2, rank2) = corners(xtrain.tokens_adapter, Gate.OVERFLOW, min_world=1, max_world=4)
    assert (case.world, case.accum_steps, micro, rank, case.precision) == (4, 3, 2, 3, "fp16")
    assert (small.world, micro2, rank2) == (2, 0, 1) and 0 not in case.empty_steps()
    assert [(c.world, r) for c, _, r in corners(xtrain.tokens_adapter, Gate.OVERFLOW)] == [(1, 0)]  # one process


def test_data_parallel_corners_have_N_2_at_W_2_and_an_empty_micro_batch_and_rank():
    got = corners(xtrain.tokens_adapter, Gate.DP_EQUIVALENCE, min_world=1, max_world=3)
    assert [c.world for c in got] == [2, 3] and all(c.accum_steps >= 2 for c in got)
    c = got[0]
    E, WB = c.accum_steps * c.micro_batch * c.world, c.micro_batch * c.world
    window0 = c.lengths[:E]
    assert len(c.lengths) == c.steps * E and not any(window0[WB:2 * WB])  # micro-batch 1 empty
    assert any(window0[2 * WB:2 * WB + c.micro_batch]) and not any(window0[3 * WB - c.micro_batch:3 * WB])  # last rank
    assert 0 not in c.empty_steps()
    assert corners(xtrain.tokens_adapter, Gate.DP_EQUIVALENCE, min_world=1, max_world=1) == []  # no W ≥ 2 to draw


def test_pipeline_corner_has_two_chunks_and_two_outer_steps_on_pp_2():
    (c,) = corners(broken_mesh.pipe, Gate.MESH_EQUIVALENCE, min_world=2, max_world=4)
    assert (c.mesh.pp, c.mesh.dp, c.pipeline_chunks, c.accum_steps // c.pipeline_chunks) == (2, 1, 2, 2)
    (split, world), = corners(broken_mesh.pipe, Gate.MESH_SPLIT_INVARIANCE, min_world=2, max_world=4)
    assert world == 2 and split.pipeline_chunks == 2 and split.accum_steps == 4 and split.mesh is None


def test_every_profile_starts_the_long_windows_with_a_run_past_256_micro_steps():
    """A narrow counter (uint8: wraps at 256) shows only in a run of more than 256 micro-steps; the long-window gate's
    random draws (N = 64..256, K = 1..2) rarely reach one, so its corner is one (planted narrow_counter: rejected
    there and at N=200 K=2, passing at N=128 K=2, 256 micro-steps — measured, the registry holds its case)."""
    for adapter in (xtrain.adapter, xtrain.tokens_adapter, xtrain.single.replace(precisions=("fp32",))):
        ((c, low),) = corners(adapter, Gate.LONG_WINDOW)
        assert (low.accum_steps, low.steps) == (LONG_N, 1) and low.seed == c.seed  # its low-precision window
        assert c.accum_steps * c.steps > 256 and c.accum_steps > 128 and 256 % c.accum_steps, c
        assert (c.micro_batch, c.world, c.lengths) == (1, 1, None)  # the cheapest such run: B = 1, unpadded


def test_corners_replace_random_draws_within_the_budget():
    for gate in (g for g, r in TABLE.items() if r.budget):
        hard = corners(xtrain.tokens_adapter, gate, min_world=1, max_world=4)
        assert random_budget(gate, hard) + len(hard) == max(gate_budget(gate), len(hard) + 1), gate


def _plugin(tmp_path, trainer, keyword):
    env = {**{k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER", "COLUMNS")},
           "PYTHONPATH": ROOT, "HYPOTHESIS_PROFILE": "dev", "OMP_NUM_THREADS": "1", "XTRAIN_DIST_MAX_WORLD": "2",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}  # a fresh example database: the corner, not a replay, finds it
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "verify", "-p", "no:cacheprovider", "-q", "-p", "no:xdist",
           "--verify-trainer", trainer, "-k", keyword]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["found_inf_of_rank_0_float", "found_inf_of_rank_0_tokens"])
def test_dev_profile_rejects_a_skip_decided_by_rank_0(tmp_path, name):
    r = _plugin(tmp_path, f"planted.broken_overflow:{name}", "overflow")
    assert r.returncode == 1, r.stdout[-3000:]
    assert "[overflow] rank 0, window 0: parameter" in r.stdout and "on rank 1 of 2" in r.stdout, r.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_dev_profile_rejects_scale_grads_under_outer_accumulation(tmp_path):
    r = _plugin(tmp_path, "planted.broken_mesh:pipe_ema", "mesh_equivalent")
    assert r.returncode == 1, r.stdout[-3000:]
    assert "[mesh equivalence] mesh dp=1 pp=2 tp=1, chunks=2, outer=2" in r.stdout, r.stdout[-3000:]
    # the correct controls pass the same corners: found_inf_all_reduced_* (test_overflow.py, on both ranks) and
    # the pipeline recipe with scale_grads=False (the example tests run its mesh gates through the plugin)


@pytest.mark.slow
def test_dev_profile_rejects_a_counter_that_wraps_past_256_micro_steps(tmp_path):
    r = _plugin(tmp_path, "planted.broken_numerics:narrow_counter", "long_accumulation")
    assert r.returncode == 1, r.stdout[-3000:]
    assert "[equivalence] float64 parameter" in r.stdout and "case N=129 B=1 K=2" in r.stdout, r.stdout[-3000:]


@pytest.mark.slow
def test_dev_profile_rejects_a_short_last_window_divided_by_n(tmp_path):
    r = _plugin(tmp_path, "planted.short_adapters:nominal_n", "big_batch")
    assert r.returncode == 1, r.stdout[-3000:]
    assert "(step 1 is the short last window: 2 of N=3 micro-batches" in r.stdout, r.stdout[-3000:]
    assert "hint: it differs in the short last window" in r.stdout, r.stdout[-3000:]


def _drawn(adapter, at_seed: int, n: int = 30) -> list:
    from hypothesis import Phase, given, seed, settings

    from verify._internal.cases.strategies import dist_cases, with_corners

    got = []

    @seed(at_seed)
    @settings(max_examples=n, database=None, deadline=None, phases=(Phase.generate,))
    @given(case=dist_cases(adapter, min_world=1, max_world=4))
    def draw(case):
        got.append(case)

    with_corners(draw, [])()
    return got


def test_a_seed_draws_the_same_cases_whatever_the_process_has_imported(tmp_path, monkeypatch):
    """hypothesis mixes the constants of the local modules a process has imported into its draws; a gate's draws
    leave them out (verify._internal.cases.strategies.seed_only_draws), so a launched world's controller (which has imported
    verify.run and more) draws the same cases as a pytest run on the same seed (tests/examples/test_launcher.py)."""
    seeds = (2, 6)  # seeds whose 30 draws pick a local constant (seed 1's do not, here)
    before = [_drawn(xtrain.adapter, s) for s in seeds]
    (tmp_path / "xtrain_probe_constants.py").write_text(  # a new local module full of seed-range integers
        "K = [" + ", ".join(str(101 + 97 * i) for i in range(600)) + "]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import xtrain_probe_constants  # noqa: F401

    try:
        assert [_drawn(xtrain.adapter, s) for s in seeds] == before
    finally:
        sys.modules.pop("xtrain_probe_constants", None)
