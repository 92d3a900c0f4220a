"""FSDP2 accumulation (xtrain_core/fsdp.py) through the gates: equivalence to the one-rank big batch and the
count table row of its sync mode, per micro-step and at the boundary; and the FSDP2 bugs it must reject."""
import re

import pytest
from tests.helpers.tiers import dev_first
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planted import broken_dist
from xtrain_proof import adapters as xtrain
from verify._internal.cases.case import Case
from verify._internal.gates import GateFailure, check_distributed
from verify._internal.gates.worlds import max_world
from verify._internal.cases.strategies import budget, dist_cases
from xtrain_core.config import ModelConfig, OptimConfig

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(max_world() < 2, reason="needs world ≥ 2")]
WORLDS = dict(min_world=2, max_world=min(3, max_world()))
TWO_BLOCKS = xtrain.XtrainOptions(model=ModelConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16),
                                  seq_len=8, optim=OptimConfig(lr=1e-2, warmup_steps=2))



@pytest.mark.parametrize("adapter", dev_first([pytest.param(xtrain.fsdp2, id="reshard"),
                                               pytest.param(xtrain.fsdp2_keep, id="keep"),
                                               pytest.param(xtrain.fsdp2_tokens, id="tokens")]))
@settings(max_examples=budget(25, 4), deadline=None)
@given(data=st.data())
def test_fsdp2_passes_its_count_row_and_the_equivalence_gate(adapter, data):
    """Per micro-step only parameter all-gathers (2 per unit resharded, 1 kept), at the boundary one
    reduction per unit; the gradient equals the big batch's; full_tensor() of every parameter is bit-equal
    across ranks after every step."""
    case = data.draw(dist_cases(adapter, **WORLDS, max_accum=4, max_steps=2))
    r = check_distributed(adapter, case)
    steps = r.extra["comm"].steps[(0, str(torch.float32))]
    assert all(len(m) == adapter.counts(case).before["all_gather"] for s in steps for m in s.micro)


def test_a_window_without_a_valid_token_skips_clippings_all_reduce():
    """loss_norm="tokens": a step whose global batch holds no valid target is skipped whole (no clip, no
    update), so its boundary lacks clipping's norm all-reduce; the row knows (found by the dev profile:
    N=1 B=1 W=2, step 1 all padding)."""
    opts = xtrain.XtrainOptions(model=ModelConfig(vocab_size=8, seq_len=24, n_layer=1, n_head=1, d_model=4),
                                seq_len=1, optim=OptimConfig(lr=1e-3, weight_decay=0.0), loss_norm="tokens")
    case = Case(accum_steps=1, micro_batch=1, steps=2, world=2, options=opts, lengths=(1, 1, 0, 0))
    assert case.empty_steps() == {1}
    check_distributed(xtrain.fsdp2_tokens, case)
    # a trainer that steps such a window anyway sends that all-reduce: rejected at step 1's boundary
    with pytest.raises(GateFailure, match=r"step 1, boundary .*a window without a valid token: no update\): count "
                                          r"table row") as e:
        check_distributed(broken_dist.fsdp2_steps_empty_windows, case)
    # gloo: all_reduce×2 expected (the units), 3 seen; NCCL: 0 expected (reduce-scatters), 1 seen
    m = re.search(r"expects all_gather×\d+, all_reduce×(\d+).* observed all_gather×\d+, all_reduce×(\d+)", str(e.value))
    assert m and int(m[2]) == int(m[1]) + 1, str(e.value)


def test_the_row_names_reduce_scatter_on_every_backend_and_gloo_reads_it_as_all_reduce():
    from verify._internal.gates.counts import as_recorded

    case = Case(accum_steps=4, micro_batch=2, steps=1, world=2, options=TWO_BLOCKS)
    row = xtrain.fsdp2_row(case)  # one row: what FSDP2 calls
    assert row.before == {"all_gather": 6} and row.boundary == {"all_gather": 6, "reduce_scatter": 3, "all_reduce": 1}
    assert as_recorded(row.boundary, "gloo") == {"all_gather": 6, "all_reduce": 4}  # what gloo records
    keep = xtrain.fsdp2_keep_row(case)
    assert keep.before == {"all_gather": 3} and keep.boundary == {"all_gather": 3, "reduce_scatter": 3, "all_reduce": 1}
    P = TWO_BLOCKS.model.n_params
    assert keep.elements[0] == P and keep.elements[1] >= P


@pytest.mark.parametrize("name,where", [
    ("fsdp2_sync_always", r"micro-step 0 of \d+ \(before the boundary\): count table row 'FSDP2, reshard after "
                          r"forward, \d+ units' expects all_gather×\d+, observed all_gather×\d+, "
                          # gloo reduces by all-reduce, NCCL by reduce-scatter (the row knows which)
                          r"(all_reduce×\d+: gloo:all_reduce float32|.*reduce_scatter×\d+.*nccl:_?reduce_scatter\w* float32)"),
    ("fsdp2_switch_after_backward", r"micro-step 0 of \d+ \(before the boundary\): count table row 'FSDP2"),
])
@settings(max_examples=budget(30, 3), deadline=None)
@given(data=st.data())
def test_rejects_fsdp2_sync_bugs_naming_the_row(name, where, data):
    """Sync never disabled: every micro-step reduces every unit. The switch set after the backward it was
    meant for: micro-step 0 runs with FSDP2's default (sync on)."""
    adapter = getattr(broken_dist, name)
    case = data.draw(dist_cases(adapter, **WORLDS, min_accum=2, max_accum=4, max_steps=2))
    with pytest.raises(GateFailure) as e:
        check_distributed(adapter, case)
    assert e.match(where), str(e.value)


def test_fsdp2_switch_set_after_forward_is_harmless():
    """Unlike DDP (which arms its reducer at forward), FSDP2 reads set_requires_gradient_sync in its
    post-backward hooks: set between forward and backward it still takes effect. The gates agree."""
    case = Case(accum_steps=3, micro_batch=2, steps=2, world=2, options=TWO_BLOCKS, seed=1, data_seed=2)
    r = check_distributed(broken_dist.fsdp2_switch_after_forward, case)
    assert r.ratio < 1, f"torch {torch.__version__}: FSDP2 with the switch after forward failed: {r}"
