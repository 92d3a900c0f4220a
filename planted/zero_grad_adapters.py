"""Planted bugs in one parameter of the biased-attention LM (tests/helpers/honest_lm.py, issue 42 item 2), which the
per-parameter checks must still reject now that a gradient zero in exact arithmetic (its key bias) is judged
against the whole gradient (verify/_internal/gates/tolerance.py, param_scale):

    bias_grad_times_n        the query bias's gradient (nonzero) × N at the boundary: one parameter's 1/N missing
    zero_grad_made_nonzero   the key bias (zero in exact arithmetic) given the value bias's gradient at N > 1
"""
from tests.helpers.honest_lm import IGNORE, SEQ, VOCAB, TokenMean

import verify


class BiasTimesN(TokenMean):
    def _boundary(self):
        super()._boundary()
        if self.count:
            self.model.q.bias.grad.mul_(self.n)


class ZeroMadeNonzero(TokenMean):
    def _boundary(self):
        super()._boundary()
        if self.count and self.n > 1:
            self.model.k.bias.grad = self.model.v.bias.grad.clone()


def _declare(cls):
    return verify.adapter(data=verify.data.tokens(vocab=VOCAB, seq_len=SEQ), ignore_index=IGNORE, data_parallel=True,
                          name=f"broken biased-attention LM ({cls.__name__})")(cls)


bias_grad_times_n = _declare(BiasTimesN)
zero_grad_made_nonzero = _declare(ZeroMadeNonzero)
