"""ms-swift's DPOTrainer on packed preference pairs (examples/swift_dpo.py), through verify.hf.trainer: the recipe
passes equivalence, the pair-mean normaliser and its logged metrics on one small case, and the same trainer with
the reduction ms-swift had before 4.6.0 (each micro-batch's pair mean, then ÷ N: PR #10144) is rejected by both
loss gates. The release matrix runs the unmodified 4.5.3 and the newest (benchmarks/stacks.py, reports/frameworks/swift)."""
import dataclasses

import pytest

pytest.importorskip("swift.rlhf_trainers", reason="ms-swift is not installed (the [swift] extra: pip install 'xtrain-verify[swift]')")

from verify import Case, Gate, GateFailure, check  # noqa: E402

from examples import swift_dpo  # noqa: E402

# 1 + 3 pairs against 2 + 2 in the first windows of data seed 2: micro-batches of unequal pair counts
CASE = Case(accum_steps=2, micro_batch=1, steps=2, seed=1, data_seed=2)


class PerMicroBatchMean(swift_dpo.PackedDPO):
    """The reduction before PR #10144: DPO's loss averaged over the micro-batch's own pairs (no window pair count,
    num_items_in_batch withheld), then divided by gradient_accumulation_steps."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None)
        return loss / self.args.gradient_accumulation_steps


def _before_the_fix():
    """The recipe's adapter on PerMicroBatchMean (the rest as declared)."""
    import verify.hf

    recipe = swift_dpo.factory
    planted = verify.hf.trainer(PerMicroBatchMean, model=swift_dpo.qwen2, template=swift_dpo.template(),
                                args=swift_dpo.ARGS, data=recipe.data, rows=swift_dpo.packed_row, logged=(),
                                declare={"batches": recipe.batches, "objective": recipe.objective,
                                         "distributed": recipe.distributed})
    return dataclasses.replace(planted, name="ms-swift DPOTrainer, its reduction before 4.6.0")


@pytest.mark.parametrize("gate", [Gate.EQUIVALENCE, Gate.NORMALISER, Gate.REPORTED_METRICS])
def test_packed_dpo_passes(gate):
    r = check(gate, swift_dpo.factory, CASE)
    assert r.ratio < 1
    if gate == Gate.REPORTED_METRICS:  # clipping active: the logged norm is told from the post-clip one
        assert r.extra["clipped_steps"] > 0, r.extra


@pytest.mark.parametrize("gate, says", [(Gate.EQUIVALENCE, r"\[equivalence\] gradient \(step 0\)"),
                                        (Gate.NORMALISER, r"additivity over windows .* weighted by sequences do not add up")])
def test_the_per_micro_batch_pair_mean_is_rejected(gate, says):
    with pytest.raises(GateFailure, match=says):
        check(gate, _before_the_fix(), CASE)
