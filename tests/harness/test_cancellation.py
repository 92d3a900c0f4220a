"""The cancellation allowance is each precision's own epsilon (verify/_internal/gates/tolerance.py, F_p): a correct
autocast trainer whose head-bias gradient cancels across micro-batches (κ 10–1000) passes hundreds of drawn
cases (1 000 measured once, 0 failed: tolerance.md), where the fp32 allowance in every precision (8·eps32·κ)
rejected it on 5 or more in 100."""
import random

import pytest
import torch

from tests.helpers.cancel_adapter import cancelling_bias
from verify._internal.cases.case import Case
from verify._internal.gates import GateFailure, check_equivalence
from verify._internal.gates import tolerance

CASES = 300  # the old rule failed ≥ 5 in 100: 300 see it at once; a rate of 1 % in 300 is seen with P = 0.95
# the held-out case that found it (issue 26): error 4.26e-3 against a bound of about 4.1e-3 before
FOUND = Case(accum_steps=8, micro_batch=4, steps=2, precision="fp16", seed=60519, data_seed=32275)


def _drawn(n: int, seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    return [FOUND] + [Case(accum_steps=rng.randint(2, 8), micro_batch=rng.randint(1, 4), steps=rng.randint(1, 2),
                           precision=rng.choice(["fp16", "bf16"]), seed=rng.randint(0, 2**16),
                           data_seed=rng.randint(0, 2**16)) for _ in range(n - 1)]


def _failures(cases) -> list[str]:
    out = []
    for c in cases:
        try:
            check_equivalence(cancelling_bias, c)
        except GateFailure as e:
            out.append(str(e))
    return out


def test_the_fp32_allowance_in_every_precision_rejects_the_correct_trainer(monkeypatch):
    """The corner is real: without F_p (the rule before: 8·eps32·κ in every precision), cancelling bias gradients
    fail a correct trainer."""
    torch.set_num_threads(1)
    for p in ("fp16", "bf16"):
        monkeypatch.setitem(tolerance.EPS, p, 0.0)
    bad = _failures(_drawn(100))
    assert len(bad) >= 5 and all("of '2.bias'" in m and "κ" in m for m in bad), bad[:3]


@pytest.mark.slow
def test_a_cancelling_bias_passes_hundreds_of_cases_in_its_own_precision():
    torch.set_num_threads(1)
    assert _failures(_drawn(CASES)) == []


def test_a_real_error_in_low_precision_still_fails():
    """The allowance grows with κ/√n − 1 only: a gradient whose blocks do not cancel gets no more room than before
    (a long window of similar rows neither), and a window summed without its 1/N is still rejected in bf16 and fp16."""
    assert tolerance.bound(1e-3, 1.0, 0.0, "bf16") == tolerance.bound(1e-3, 1.0, 0.0, "fp32")
    assert tolerance.bound(1e-3, 16.0, 0.0, "bf16", blocks=256) == tolerance.bound(1e-3, 16.0, 0.0, "fp32", blocks=256)

    class NoScale(cancelling_bias.factory):
        def micro_step(self, x, y, micro):
            self.n = 1  # the 1/N forgotten
            super().micro_step(x, y, micro)

    from verify import adapter

    broken = adapter(data=cancelling_bias.data, precisions=cancelling_bias.precisions)(NoScale)
    for p in ("fp16", "bf16"):
        with pytest.raises(GateFailure, match=r"^\[equivalence\] "):
            check_equivalence(broken, FOUND.replace(precision=p))
