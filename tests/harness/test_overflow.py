"""The injected-overflow gate (verify/_internal/gates/overflow.py): correct fp16 trainers skip an overflowing window
whole on every rank; each planted overflow bug is rejected naming the window and the rank
(planted/registry.py, driven by test_planted.py)."""
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import verify
from planted import overflow_adapters as oa
from planted import broken_overflow as bo
from xtrain_proof import adapters as xtrain
from verify._internal.cases.case import Case
from verify._internal.gates import GateSkipped
from verify._internal.gates.worlds import max_world
from verify._internal.gates.overflow import BackwardInf, check_overflow
from verify._internal.cases.strategies import budget, cases
from xtrain_core.config import ModelConfig, OptimConfig

SMALL = xtrain.XtrainOptions(model=ModelConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=1, d_model=8), seq_len=4,
                             optim=OptimConfig(lr=1e-2))
pytestmark = pytest.mark.distributed


def _case(N=3, W=1, options=SMALL):
    return Case(accum_steps=N, micro_batch=2, steps=2, world=W, precision="fp16", options=options)


@settings(max_examples=budget(25, 4), deadline=None)
@given(data=st.data())
def test_xtrain_skips_an_overflowing_window_whole_on_every_rank(data):
    W = data.draw(st.integers(1, min(4, max_world())), label="world")
    case = data.draw(cases(xtrain.tokens_adapter, world=W, max_accum=4, max_micro_batch=2, min_steps=2, max_steps=2),
                     label="case").replace(precision="fp16")
    assume(0 not in case.empty_steps())
    micro = data.draw(st.integers(0, case.accum_steps - 1), label="micro")
    rank = data.draw(st.integers(0, W - 1), label="rank")
    result = check_overflow(xtrain.tokens_adapter, case, micro, rank)
    assert "as the big batch's" in result.worst  # the scale was compared, and backed off once


@pytest.mark.parametrize("adapter", [xtrain.torch_ddp, xtrain.data_parallel])
def test_other_xtrain_fp16_trainers_pass_at_two_ranks(adapter):
    check_overflow(adapter, _case(N=2, W=2), 1, 1)


def test_float_data_overflows_by_the_harness_or_by_scaled_rows():
    """The generic route: nothing declared but fp16, the harness injects; or the declared overflow_rows hook."""
    for W, micro, rank in ((1, 2, 0), (2, 0, 1)):
        check_overflow(oa.scaled, _case(W=W, options=None), micro, rank)
    check_overflow(oa.scaled.replace(overflow=verify.data.overflow_rows), _case(options=None), 2, 0)
    # local_clean, which clears a rank's own overflow before the all-reduce, is a planted bug (planted.py)


def test_the_gate_is_skipped_without_fp16():
    with pytest.raises(GateSkipped, match="does not declare fp16"):
        check_overflow(oa.no_fp16, _case(options=None), 0, 0)


def test_the_harness_injects_into_token_models_without_a_hook():
    """Integer inputs, no overflow= hook: BackwardInf makes the micro-step's backward non-finite; xtrain's
    trainers (its own bucketed all-reduce, torch DDP) skip the window whole, the scale backed off once."""
    assert "skipped on all 1 rank(s)" in check_overflow(oa.tokens_injected, _case(N=3), 2, 0).worst
    for adapter in (oa.tokens_injected, oa.ddp_injected, oa.dist_injected):
        assert "as the big batch's" in check_overflow(adapter, _case(N=3, W=2), 2, 1).worst


@pytest.mark.parametrize("adapter, broken", [(bo.found_inf_all_reduced_tokens, bo.found_inf_of_rank_0_tokens),
                                             (bo.found_inf_all_reduced_float, bo.found_inf_of_rank_0_float)],
                         ids=["tokens", "float"])
def test_found_inf_all_reduced_passes_and_broadcast_from_rank_0_passes_only_on_rank_0(adapter, broken):
    """The control (found_inf all-reduced) passes wherever the overflow is; the planted bug (broadcast from rank
    0) passes when rank 0 overflows — why every profile draws the overflow on the last rank first — and is
    rejected on rank 1 (test_planted.py)."""
    for rank in (0, 1):
        check_overflow(adapter, _case(W=2, options=None), 2, rank)
    check_overflow(broken, _case(W=2, options=None), 2, 0)


def test_the_injection_hits_the_overflowing_rows_once_and_leaves_no_hook():
    lin = torch.nn.Linear(3, 2)
    shot = BackwardInf(slice(2, 4), 6).arm()
    x = torch.randn(6, 3, requires_grad=True)
    lin(x).sum().backward()
    assert shot.fired and shot._handle is None  # disarmed by its own firing
    bad = [r for r in range(6) if not torch.isfinite(x.grad[r]).all()]
    assert bad == [2] and not torch.isfinite(lin.bias.grad).all()  # the first overflowing row, as a real overflow
    x.grad = None
    lin(x).sum().backward()  # fired once: the next backward is untouched
    assert torch.isfinite(x.grad).all()


class _NoModule:
    """A trainer without an nn.Module (a raw parameter and x @ w): nothing the injection can reach."""

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.w = torch.randn(8, 1, device=spec.device, dtype=spec.dtype, requires_grad=True)
        self.opt, self.n = torch.optim.SGD([self.w], lr=0.1), spec.accum_steps

    def micro_step(self, x, y, micro):
        (torch.nn.functional.mse_loss(x @ self.w, y) / self.n).backward()

    def grads(self):
        return {"w": self.w.grad}

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        return torch.zeros(())

    def params(self):
        return {"w": self.w}


def test_no_module_to_inject_into_is_a_skip_naming_the_hook():
    from torch.nn.modules import module

    adapter = verify.adapter(data=verify.data.regression(features=8), precisions=("fp32", "fp16"))(_NoModule)
    with pytest.raises(GateSkipped, match=r"could not inject the overflow; declare numerics=verify.Numerics\(overflow=...\)"):
        check_overflow(adapter, _case(options=None), 1, 0)
    assert not module._global_forward_hooks  # disarmed: the process-wide hook did not outlive the run
