"""Which fault operators apply to an adapter (verify.selftest.operators, Operator.applies): an operator whose
edit plants nothing for this adapter must be "n/a", never a survivor the score counts."""
import dataclasses

import verify
from examples.mlp_regressor import factory as mlp
from verify.selftest.operators import OPERATORS


def test_the_norm_after_clipping_is_a_bug_only_where_the_adapter_clips():
    """grad_norm_post_clip rescales the logged norm by min(1, max_norm / norm): without a max_norm it changes
    nothing, and the self-test once counted it SURVIVED on a trainer that logs grad_norm and never clips (the
    zoo's t77, a tp MLP)."""
    op = OPERATORS["grad_norm_post_clip"]
    names = ("loss", "grad_norm", "lr", "rows")
    unclipped = mlp.replace(metrics=verify.Metrics(names=names), ref="examples.mlp_regressor:factory")
    assert op.applies(mlp) and not op.applies(unclipped)
    drawn = mlp.replace(metrics=verify.Metrics(names=names, max_norm=lambda o: o), ref="examples.mlp_regressor:factory")
    assert op.applies(dataclasses.replace(drawn, defaults=10.0)) and not op.applies(drawn)  # defaults None: no clip
    assert OPERATORS["grad_norm_zero"].applies(unclipped)  # the other norm bugs exist without clipping
