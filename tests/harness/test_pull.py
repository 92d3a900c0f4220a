"""verify.Pull: a loop the framework owns, driven as the four-method trainer. Small loops (planted/pull_loops.py)
that prefetch the window and clip, then the gates on them: a correct loop passes, a ×N loss is rejected
although the loop clips (the gradient is read before clipping), the framework's errors surface with
their traceback, and no thread is left behind."""
import importlib.util
import os
import threading

import pytest
from tests.helpers.tiers import imports_framework
import torch

import verify
from verify._internal.cases.case import Case, drive, split
from verify._internal.gates import check_equivalence

from planted import pull_loops


_BEFORE = set()


@pytest.fixture(autouse=True)
def _threads_before():
    _BEFORE.clear()
    _BEFORE.update(threading.enumerate())


def _pull_threads():
    """This test's framework threads still running a second after their Pull was dropped or failed."""
    mine = [t for t in threading.enumerate() if t.name == "verify-pull" and t not in _BEFORE]
    for t in mine:
        t.join(timeout=1)
    return [t for t in mine if t.is_alive()]


@pytest.mark.parametrize("case", [Case(accum_steps=1, micro_batch=1, steps=1),
                                  Case(accum_steps=4, micro_batch=2, steps=3, seed=3, data_seed=5)])
def test_a_prefetching_loop_with_clipping_passes_the_gates(case):
    r = check_equivalence(pull_loops.correct, case)
    assert r.ratio < 1
    assert _pull_threads() == []  # each dropped Pull stopped its thread


def test_a_batch_rebuilt_from_its_items_and_copied_is_the_batch_taken():
    # ms-swift moves a batch as type(batch)({k: ...}) and its DPO forward edits batch.copy(): both are the batch
    # already taken from the harness, not a second micro-batch
    r = check_equivalence(pull_loops.rebuilt, Case(accum_steps=3, micro_batch=2, steps=2, seed=2, data_seed=3))
    assert r.ratio < 1
    assert _pull_threads() == []


def test_grads_are_read_before_clipping_so_times_N_is_rejected():
    case = Case(accum_steps=4, micro_batch=2, steps=1)
    spec = case.spec()
    t = pull_loops.times_n(spec)
    for m, (x, y) in enumerate(split(*case.batches(pull_loops.times_n)[0], 4)):
        t.micro_step(x.float(), y.float(), m)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in t.grads().values()])).item()
    assert norm > 1.0  # the loop clips at 1.0 right after: grads() saw the gradient before it
    t.optimizer_step()  # the equivalence gate rejects it: the planted bug pull_times_n (planted.py)


def test_the_framework_error_surfaces_with_its_traceback():
    case = Case(accum_steps=2, micro_batch=1, steps=2)
    with pytest.raises(verify.PullError, match=r"(?s)raised \(in its thread\).*planted failure in the framework's loop"):
        drive(pull_loops.fails(case.spec()), case.batches(pull_loops.fails), 2)
    assert _pull_threads() == []


def test_a_window_longer_than_accum_steps_is_named_not_hung():
    case = Case(accum_steps=2, micro_batch=1, steps=1)
    with pytest.raises(verify.PullError, match="asked for another micro-batch instead of reaching its optimizer step"):
        drive(pull_loops.long_window(case.spec()), case.batches(pull_loops.long_window), 2)
    assert _pull_threads() == []  # stopped at once, not left waiting for its timeout


def test_a_loop_that_never_reads_the_dataset_is_told_so():
    with pytest.raises(verify.PullError, match="hand it Pull.dataset"):
        verify.Pull(timeout=5).start(lambda: None, torch.nn.Linear(1, 1))


needs = lambda mod: pytest.mark.skipif(importlib.util.find_spec(mod) is None,  # noqa: E731
                                       reason=f"{mod} is not installed (the [examples] extra)")


@imports_framework
@needs("transformers")
def test_hf_trainer_with_a_per_micro_batch_mean_is_rejected_on_padded_data():
    """The historical HF bug (each micro-batch's own token mean ÷ N): padded micro-batches with 8 and 2
    valid labels. The recipe passes the same case."""
    from examples.hf_trainer import factory
    from planted import framework_bugs

    case = Case(accum_steps=2, micro_batch=1, steps=1, lengths=(8, 2))
    assert check_equivalence(factory, case).ratio < 1  # the bug, on this case: planted.py's hf_per_micro_batch_mean
    assert framework_bugs.hf_per_micro_batch_mean.factory is not factory.factory


@imports_framework
@needs("lightning")
def test_lightning_with_the_loss_divided_by_N_twice_is_rejected():
    from examples.lightning_trainer import factory
    from planted import framework_bugs

    case = Case(accum_steps=3, micro_batch=2, steps=2)
    assert check_equivalence(factory, case).ratio < 1  # the bug, on this case: planted.py's lightning_over_n_twice
    assert framework_bugs.lightning_over_n_twice.factory is not factory.factory


def test_causal_lm_targets_are_what_a_label_shifting_model_predicts():
    """HF causal LMs shift labels inside the model (logits[:, :-1] against labels[:, 1:]): shifted_labels puts
    the harness's targets exactly there, so the model's count of valid labels is the harness's."""
    x, y = verify.data.causal_lm(vocab=16, seq_len=5)(3, 7)
    assert x.shape == (3, 6) and y.shape == (3, 5) and torch.equal(x[:, 1:], y)
    y = y.clone()
    y[0, 2:], y[1, :] = -100, -100  # the harness's padding: 2, 0 and 5 valid targets
    labels = verify.data.shifted_labels(y)
    assert labels.shape == x.shape and (labels[:, 0] == -100).all() and torch.equal(labels[:, 1:], y)
    assert int(labels[..., 1:].ne(-100).sum()) == int(y.ne(-100).sum()) == 7


def test_environment_the_loop_removed_is_put_back(monkeypatch):
    """Lightning's teardown deletes WORLD_SIZE; a harness rank process builds more trainers after it."""
    monkeypatch.setenv("VERIFY_PULL_PROBE", "kept")
    model = torch.nn.Linear(1, 1)
    pull = verify.Pull(timeout=5)

    def loop():
        del os.environ["VERIFY_PULL_PROBE"]
        pull_dataset[0].to("cpu")  # waits for a micro-batch until the Pull is dropped

    pull_dataset = pull.dataset
    pull.start(loop, model)
    del pull
    assert _pull_threads() == [] and os.environ.get("VERIFY_PULL_PROBE") == "kept"
