"""The path-parity gate (verify/_internal/gates/parity.py): a declared switch on vs off on the same windows. A
correct trainer passes bit for bit on drawn cases (xtrain's activation checkpointing, the planted MLP counting rows
in its loop); a count advanced in a recomputed forward is rejected (planted/registry.py); a switch whose math
differs is judged by the precision bound; a bad declaration is one AdapterError naming the field."""
import dataclasses

import pytest
import torch
from hypothesis import given, settings

import verify
from planted import parity_adapters as pa
from verify._internal.cases.case import Case
from verify._internal.cases.strategies import cases
from verify._internal.gates import GateFailure, GateSkipped
from verify._internal.gates.parity import check_parity
from xtrain_proof import adapters as xtrain

CASE = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2)


@pytest.mark.parametrize("adapter", [pa.rows_counted_in_the_loop, xtrain.adapter], ids=["planted MLP", "xtrain"])
def test_a_correct_switch_is_bit_equal_on_drawn_cases(adapter):
    @settings(max_examples=3, deadline=None)
    @given(case=cases(adapter, max_accum=4, max_micro_batch=2, max_steps=2))
    def parity(case):
        r = check_parity(adapter, case)
        assert r.worst == "bit-equal" and r.ratio == 0 and r.extra["exact"], r

    parity()


class Reordered(pa.RowsCountedInTheLoop):
    """The 'fused' side scales the squared errors by 3 and the sum back by 1/3: the same math, other roundings."""

    def micro_step(self, x, y, micro):
        if not self.checkpointing:
            return super().micro_step(x, y, micro)
        err = (self.head(self.body(x)) - y) ** 2
        loss = (err * 3.0).sum() / 3.0
        loss.backward()
        self.total += float(loss.detach())
        self.rows += x.shape[0]


def test_a_switch_whose_math_differs_is_judged_by_the_precision_bound():
    inexact = verify.Parity(name="a reordered loss", apply=pa.with_checkpointing, exact=False)
    exact = dataclasses.replace(inexact, exact=True)
    declare = dict(data=verify.data.regression(features=8), options=pa.rows_counted_in_the_loop.options,
                   defaults=pa.Options())
    r = check_parity(verify.adapter(parity=inexact, **declare)(Reordered), CASE)
    assert r.ratio < 1 and r.extra["exact"] is False, r
    with pytest.raises(GateFailure, match=r"^\[path parity\] a reordered loss on vs off.*declared exact"):
        check_parity(verify.adapter(parity=exact, **declare)(Reordered), CASE)  # exact: the last bits count


def test_undeclared_is_skipped_saying_how_and_a_bad_declaration_names_its_field():
    from examples.mlp_regressor import factory

    with pytest.raises(GateSkipped, match=r"declares no switch .*verify.Parity\(name=\.\.\., apply=\.\.\.\)"):
        check_parity(factory, CASE)
    for kwargs, says in ((dict(name="", apply=pa.with_checkpointing), "Parity.name must be a non-empty string"),
                         (dict(name="x", apply=3), "Parity.apply must be callable"),
                         (dict(name="x", apply=pa.with_checkpointing, exact=1), "Parity.exact must be True or False")):
        with pytest.raises(verify.AdapterError, match=says):
            verify.Parity(**kwargs)
    with pytest.raises(verify.AdapterError, match=r"parity= must be a verify.Parity"):
        verify.adapter(data=verify.data.regression(features=8), parity="checkpointing")(pa.RowsCountedInTheLoop)


def test_checkpointing_leaves_xtrains_model_bit_equal():
    """ModelConfig.checkpoint: the same logits and gradients, bit for bit (the parity gate's premise for xtrain)."""
    from xtrain_core.config import ModelConfig
    from xtrain_core.model import build_model

    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for on in (False, True):
        model = build_model(ModelConfig(checkpoint=on), 0)
        model(idx).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
