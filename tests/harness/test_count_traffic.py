"""Declared collectives are honoured by every gate (issue 15 item 10): a trainer that reduces its token
count on every micro-step (torchtitan's all_reduce, HF's all_gather of num_items_in_batch) and declares it
passes boundary-only, data-parallel equivalence and bytes per step; undeclared, or declared only for
another world, the same traffic fails. (The plugin run of every gate on them: tests/examples/test_examples.py.)"""
import pytest

from planted import count_adapters as ca
from xtrain_proof import adapters as xtrain
from verify._internal.cases.case import Case
from verify._internal.gates import check_distributed, check_same_bytes
from verify._internal.gates.worlds import max_world
from xtrain_core.config import ModelConfig, OptimConfig

pytestmark = pytest.mark.distributed
needs_2 = pytest.mark.skipif(max_world() < 2, reason="needs world ≥ 2 (XTRAIN_DIST_MAX_WORLD / GPUs)")
# padded: two steps, step 0's first micro-step empty on every rank, a rank without a token in step 1
PADDED = Case(accum_steps=3, micro_batch=1, steps=2, world=2, lengths=(0, 0, 2, 5, 1, 0) + (0, 3, 0, 4, 0, 1))


@needs_2
@pytest.mark.parametrize("adapter", [ca.counted, ca.gathered], ids=["all_reduce", "all_gather"])
def test_declared_count_traffic_passes_boundary_only_equivalence_and_bytes(adapter):
    r = check_same_bytes(adapter, PADDED)  # both gates at N=3, then N=1 over the same window
    used = r.extra["comm"].expected_used
    assert {(rank, k, m) for rank, dt, k, m, *_ in used if dt == "torch.float32"} == {
        (rank, k, m) for rank in (0, 1) for k in (0, 1) for m in (0, 1)}  # one count per micro-step 0..N-2
    check_distributed(adapter, PADDED.replace(world=1, lengths=PADDED.lengths[:6]))  # world 1: a one-rank group


# Undeclared, the same traffic fails boundary-only; declared for world 1 only, it fails at world 2: the planted
# bugs count_reduced_undeclared and declared_at_world_1_only on PADDED (planted/registry.py, driven by tests/harness/test_planted.py).


@needs_2
def test_an_expected_entry_for_world_1_excuses_it_at_world_1():
    check_distributed(ca.declared_at_world_1_only, PADDED.replace(world=1, lengths=PADDED.lengths[:6]))


@needs_2
def test_bytes_per_step_reruns_the_same_window_at_n1():
    """The N=1 re-run keeps the case's whole window (lengths included). It used to keep the first E/N
    lengths only: here an all-padding window, which FSDP2 steps without clipping's norm all-reduce, so a
    correct trainer failed with a bare AssertionError."""
    opts = xtrain.XtrainOptions(model=ModelConfig(vocab_size=8, seq_len=8, n_layer=1, n_head=1, d_model=4),
                                seq_len=4, optim=OptimConfig(lr=1e-3, max_grad_norm=1.0), loss_norm="tokens")
    case = Case(accum_steps=2, micro_batch=1, steps=1, world=2, options=opts, lengths=(0, 0, 3, 4))
    check_same_bytes(xtrain.fsdp2_tokens, case)


@needs_2
def test_boundary_traffic_that_grows_with_n_fails_bytes_per_step():
    """N logging all-reduces at the boundary pass boundary-only (side-channel scalars) but not bytes per step,
    which fails naming both runs (the planted bug logs_each_micro_loss (planted/registry.py, driven by tests/harness/test_planted.py))."""
    case = PADDED.replace(steps=1, lengths=PADDED.lengths[:6])
    check_distributed(ca.logs_each_micro_loss, case)


@needs_2
def test_boundary_traffic_declared_as_sized_side_traffic_passes_bytes_per_step():
    """The same N logging all-reduces, declared in the row's side (one float each, N per step): the gradient's
    bytes stay the same at N and N=1, so bytes per step passes (TRL's metrics: examples/trl_grpo.py)."""
    r = check_same_bytes(ca.logs_declared, PADDED)
    side = r.extra["comm"].steps[(0, "torch.float32")][0].side
    assert [c.numel for c in side] == [1] * PADDED.accum_steps
    assert r.extra["declared_side_traffic"] == 2 * 2 * 2 * PADDED.accum_steps  # ranks × dtypes × steps × N


@pytest.mark.slow
@pytest.mark.parametrize("name", ["counted", "gathered"])
def test_declared_count_traffic_passes_every_gate_through_the_plugin(tmp_path, name):
    """From an empty directory, every gate at the default worlds 1..4, split invariance on padded data."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "HYPOTHESIS_PROFILE": "dev", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "verify", "-p", "no:cacheprovider", "-q",
                        "--verify-trainer", f"planted.count_adapters:{name}"], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    gates = json.loads((tmp_path / "reports" / "verify-report.json").read_text())["gates"]
    assert gates["split invariance"]["examples"] > 0 and gates["boundary-only"]["expected_before_boundary"] > 0


# -- a reduce-scatter on gloo (issue 42 item 8): the row names what the trainer calls, once for every backend ----------

ZERO = Case(accum_steps=3, micro_batch=2, steps=2, world=2, seed=1, data_seed=2)


@needs_2
def test_a_hand_written_reduce_scatter_row_is_written_once_and_passes_on_gloo():
    """planted/zero_adapters.py reduce-scatters with reduce_scatter_tensor and declares {reduce_scatter: 1, ...} with
    no backend branch: on gloo torch runs it as one all-reduce, which is what the recorder sees and what the row is
    read as; equivalence and bytes per step pass too."""
    from planted import zero_adapters as z

    r = check_same_bytes(z.zero, ZERO)
    from verify._internal.ranks.comm import family

    boundary = r.extra["comm"].steps[(0, "torch.float32")][0].boundary
    gloo = {c.backend for c in boundary} == {"gloo"}
    assert sorted(family(c.op) for c in boundary) == (["all_gather", "all_reduce", "all_reduce"] if gloo else
                                                      ["all_gather", "all_reduce", "reduce_scatter"])


@needs_2
def test_a_wrong_reduce_scatter_count_still_fails_on_gloo():
    """The same trainer under a row claiming two reduce-scatters: one all-reduce too few, named with the reading."""
    from planted import zero_adapters as z
    from verify._internal.gates import GateFailure
    from verify._internal.verdict import Gate

    with pytest.raises(GateFailure) as e:
        check_distributed(z.zero_miscounted, ZERO)
    msg = str(e.value)
    assert e.value.gate is Gate.BOUNDARY_ONLY and "count table row 'hand-written ZeRO-1, two reduce-scatters " \
        "claimed' expects all_gather×1, all_reduce×3, observed all_gather×1, all_reduce×2" in msg, msg
    assert "(gloo records each reduce_scatter as an all_reduce, so the row's reduce_scatter counts as all_reduce " \
           "here" in msg, msg
