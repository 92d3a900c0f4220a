"""The normaliser gate's "one sequence as its two halves" check judges only a split that changes the normaliser
(issue 42, item 2): it masks a completion's head, so no helper of ours may turn a masked target into another input.
`verify.data.unpack_rollouts` keeps every id and gives the loss mask apart; a DAPO-style trainer feeding its policy
those ids passes, and one whose input does change with the mask is told so, not only "its own length"."""
import pytest
import torch

import verify
from tests.helpers import honest_lm
from tests.helpers.honest_lm import COMPLETION, IGNORE, PROMPT, VOCAB, Dapo, dapo, lm
from verify._internal.cases.case import Case
from verify._internal.gates import GateFailure, check_equivalence, check_normaliser
from verify._internal.gates.distributed import check_distributed

# the case on which the DAPO trainer reading the helper's ids failed (relative error 5.4e-2 on the loss): row 0 of
# window A holds 2 valid targets, halved into 1 + 1, so the tail's token saw a 0 where the head's id was
FAILED = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, lengths=(2, 4, 0, 0, 0, 0, 4, 5, 5, 5, 5, 5))


class ZeroedIds(Dapo):
    """What the helper did before: masked completion ids set to 0 before the policy reads them."""

    def token_losses(self, x, y):
        x = x.clone()
        x[:, 0, -y.shape[1]:] *= (y != IGNORE)
        return super().token_losses(x, y)


zeroed = verify.adapter(data=verify.data.rollouts(vocab=VOCAB, prompt_len=PROMPT, completion_len=COMPLETION),
                        ignore_index=IGNORE, name="DAPO policy reading ids zeroed where masked")(ZeroedIds)


def test_unpack_rollouts_keeps_every_id_and_gives_the_mask_apart():
    x, y = verify.data.rollouts(vocab=VOCAB, prompt_len=PROMPT, completion_len=COMPLETION)(4, 7)
    masked = y.clone()
    masked[0, :2], masked[1, 3:], masked[2] = IGNORE, IGNORE, IGNORE  # a head, a tail, a whole completion
    r, whole = verify.data.unpack_rollouts(x, masked, IGNORE), verify.data.unpack_rollouts(x, y, IGNORE)
    assert torch.equal(r.completion_ids, y) and torch.equal(r.completion_ids, whole.completion_ids)
    assert torch.equal(r.prompt_ids, x[:, 0, :PROMPT].long())
    assert torch.equal(r.completion_mask, (masked != IGNORE).long())
    assert r.completion_mask.sum() == y.numel() - 2 - (COMPLETION - 3) - COMPLETION


def test_a_dapo_trainer_reading_the_helpers_ids_passes_the_halves():
    result = check_normaliser(dapo, FAILED)
    assert result.extra["halved"] == "row 0 of window A" and result.ratio < 1


def test_a_trainer_whose_input_changes_with_the_mask_is_told_so():
    with pytest.raises(GateFailure) as e:
        check_normaliser(zeroed, FAILED)
    msg = str(e.value)
    assert "as its two halves (1 + 1)" in msg and "add up neither by their valid counts nor plainly" in msg, msg
    assert "the model's input changes with which targets are masked" in msg, msg
    assert "feed the model the same input whatever targets are ignore_index" in e.value.hint


def test_a_wrong_in_row_normaliser_is_still_named_by_the_weights_that_fit():
    """Dr. GRPO's constant taken from the micro-batch's longest sequence: its halves add up by valid counts."""
    from planted.objective_adapters import dr_grpo_own_length

    with pytest.raises(GateFailure) as e:
        check_normaliser(dr_grpo_own_length, FAILED.replace(lengths=(6, 1, 2, 0, 3, 5, 2, 3, 4, 4, 1, 2)))
    assert "do not add up plainly: the term divides a sequence by its own length" in str(e.value), str(e.value)


@pytest.mark.distributed
@pytest.mark.parametrize("adapter", [dapo, lm], ids=["dapo", "lm"])
def test_the_honest_trainers_pass_undeclared_in_one_process_and_on_two_ranks(adapter):
    assert check_equivalence(adapter, FAILED).ratio < 1
    assert check_distributed(adapter, FAILED.replace(world=2, micro_batch=1)).ratio < 1
    assert honest_lm.lm.objective is None and honest_lm.dapo.objective is None  # nothing declared but the padding
