"""The injected-overflow gate (verify/gates/overflow.py): correct fp16 trainers skip an overflowing window
whole on every rank; each planted overflow bug is rejected naming the window and the rank
(verify/adapters/planted.py, driven by test_planted.py)."""
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.helpers import overflow_adapters as oa
from verify.adapters import xtrain
from verify.case import Case
from verify.gates import GateSkipped
from verify.gates.distributed import max_world
from verify.gates.overflow import check_overflow
from verify.strategies import budget, cases
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


def test_float_data_overflows_by_scaled_rows():
    """The generic route: nothing declared but fp16; verify.data.overflow_rows scales the rows."""
    for W, micro, rank in ((1, 2, 0), (2, 0, 1)):
        check_overflow(oa.scaled, _case(W=W, options=None), micro, rank)
    # local_clean, which clears a rank's own overflow before the all-reduce, is a planted bug (planted.py)


def test_the_gate_is_skipped_without_fp16_or_a_way_to_overflow():
    with pytest.raises(GateSkipped, match="does not declare fp16"):
        check_overflow(oa.no_fp16, _case(options=None), 0, 0)
    with pytest.raises(GateSkipped, match=r"inputs are torch.int64 .* no Adapter\(overflow=...\)"):
        check_overflow(xtrain.adapter.replace(overflow=None), _case(), 0, 0)
