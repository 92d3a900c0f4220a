"""Packed rows (issue 29, item 5): verify.data.packed and its documents, the harness's splits never cutting a packed
row, the normaliser gate's halves on a row of several documents, and packed windows drawn under every profile."""
import pytest
import torch
from hypothesis import given, settings

from verify import Gate
import verify
from examples import packed_documents as recipe
from planted import packed_adapters as pa
from planted.registry import PACKED
from verify._internal.cases.case import shard
from verify._internal.cases.strategies import cases, with_corners
from verify._internal.gates.table import gate_budget
from verify._internal.cases.corners import corners
from verify._internal.gates import GateFailure, check_normaliser
from verify._internal.gates.tokens import windows_case
from verify._internal.settings import PROFILES

IGNORE = -100
make = verify.data.packed(vocab=16, seq_len=12, max_docs=3, ignore_index=IGNORE)


def _documents_of(x, y):
    """[(row, start, end)] of every document, from the position ids."""
    out = []
    for r in range(x.shape[0]):
        starts = (x[r, 1] == 0).nonzero().flatten().tolist()
        out += [(r, s, e) for s, e in zip(starts, starts[1:] + [x.shape[2]])]
    return out


def test_documents_restart_their_positions_and_never_span_a_row():
    x, y = make(64, 3)
    assert x.shape == (64, 2, 12) and y.shape == (64, 12) and x.dtype == y.dtype == torch.int64
    assert (x[:, 1, 0] == 0).all()  # every row starts a document: none continues from the row before
    seg = verify.data.documents(x)
    for r, s, e in _documents_of(x, y):
        assert torch.equal(x[r, 1, s:e], torch.arange(e - s)), (r, s, e)  # positions restart at each document
        assert (seg[r, s:e] == seg[r, s]).all()
        assert torch.equal(y[r, s:e - 1], x[r, 0, s + 1:e]) and y[r, e - 1] == IGNORE  # no target crosses it
        assert int((y[r, s:e] != IGNORE).sum()) >= 1  # every document has a target
    assert torch.equal(verify.data.count_documents(x, y), seg.max(dim=1).values + 1)


def test_documents_and_their_lengths_vary_and_the_data_is_deterministic_per_seed():
    x, y = make(64, 3)
    docs = verify.data.count_documents(x, y)
    assert set(docs.tolist()) == {1, 2, 3}
    assert len({e - s for _, s, e in _documents_of(x, y)}) >= 4
    again = make(64, 3)
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert not torch.equal(x, make(64, 4)[0])
    assert torch.equal(make(8, 3)[0], make(8, 3)[0])


@pytest.mark.parametrize("kwargs", [dict(vocab=1, seq_len=8), dict(vocab=4, seq_len=1), dict(vocab=4, seq_len=8, max_docs=5)])
def test_packed_says_which_argument_is_wrong(kwargs):
    with pytest.raises(ValueError, match="packed needs vocab ≥ 2, seq_len ≥ 2 and 1 ≤ max_docs ≤ seq_len // 2"):
        verify.data.packed(**kwargs)


@settings(max_examples=10, deadline=None)
@given(case=cases(recipe.factory, world=2))
def test_no_split_of_the_harness_cuts_a_packed_row(case):
    """Rows are the unit: every micro-batch of every rank holds whole rows, each starting a document, and the
    documents of the micro-batches add up to the global batch's."""
    for x, y in case.batches(recipe.factory):
        per_micro = []
        for rank in range(case.world):
            for xm, ym in shard(x, y, case.accum_steps, rank, case.world):
                assert xm.shape[1:] == x.shape[1:] and (xm[:, 1, 0] == 0).all()
                per_micro.append(int(verify.data.count_documents(xm, ym).sum()))
        assert sum(per_micro) == int(verify.data.count_documents(x, y).sum())


def test_the_halves_of_a_packed_row_are_one_documents():
    """pack_mean_per_doc (a token mean per packed row ÷ the window's documents) adds up by documents and pads
    right: only halving one document of a packed row shows it. Without the segments (a sequences callable that
    has none), the gate halves only rows of one document and passes it: the check is what rejects it."""
    with pytest.raises(GateFailure, match=r"one sequence \(row 0 of window A, sequence 0 of its 2, the others as "
                                          r"they are, \d+ valid targets\)"):
        check_normaliser(pa.pack_mean_per_doc, PACKED)
    blind = verify.adapter(data=recipe.factory.data, ignore_index=IGNORE, data_parallel=True,
                           objective=verify.Objective(terms={"loss": "seq_mean"}, sequences=_count_without_segments))(
        pa.PackMeanPerDoc)
    r = check_normaliser(blind, PACKED)
    assert r.ratio < 1 and r.extra["packed_rows"] > 0 and not r.extra["halved_packed"], r.extra


def _count_without_segments(inputs, targets):
    return verify.data.count_documents(inputs, targets)


class _TokenSums(recipe.Trainer):
    """The recipe's model with a loss over the pack's tokens: `per_row` Σ tokens (÷ `constant`), `units` the count."""

    constant, counted = 1.0, "valid"

    def micro_step(self, x, y, micro):
        valid = y != IGNORE
        logits = self.model(x[:, 0], x[:, 1])
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.clamp(min=0).flatten(), reduction="none")
        num = (ce.view_as(y) * valid).sum() / self.constant
        num.backward()
        units = {"valid": valid.sum(), "docs": verify.data.count_documents(x, y).sum(), "one": torch.tensor(1.0)}
        self.window += torch.stack([num.detach(), units[self.counted].to(self.window.dtype), valid.sum().to(num.dtype)])
        if micro == self.n - 1:
            if self.counted == "one":
                self.window[1] = 1.0
            self.boundary()


class _DrGrpo(_TokenSums):
    constant, counted = float(recipe.SEQ_LEN), "docs"


class _Sum(_TokenSums):
    counted = "one"


@pytest.mark.parametrize("cls,kind", [(_TokenSums, "token_mean"), (_DrGrpo, "seq_sum"), (_Sum, "sum")])
def test_every_normaliser_over_tokens_passes_on_packed_rows_halved_whole(cls, kind):
    """A token mean, Dr. GRPO's Σ ÷ (documents × constant) and a sum over packed rows: with the segments the gate
    halves a packed row's valid targets whole (documents do not weigh inside it), and a correct trainer passes."""
    a = verify.adapter(data=recipe.factory.data, ignore_index=IGNORE, data_parallel=True,
                       objective=verify.Objective(terms={"loss": kind}, sequences=verify.data.count_documents))(cls)
    r = check_normaliser(a, PACKED)
    assert r.ratio < 1 and r.extra["halved_packed"] and "all 2 sequences" in r.extra["halved"], r.extra


@pytest.mark.parametrize("profile", PROFILES)
def test_packed_windows_are_drawn_under_every_profile(profile):
    """The normaliser gate's draws of the packed recipe under each profile (its corner first, never shrunk): at least
    GATE_MIN_EXAMPLES, windows holding packed rows among them, and the corner's window A starting with a packed row,
    so the gate halves one of its documents there (as it does: halved_packed)."""
    hard, n = corners(recipe.factory, Gate.NORMALISER), settings.get_profile(profile).max_examples
    budget = gate_budget(Gate.NORMALISER, n)
    drawn = []

    @settings(settings.get_profile(profile), max_examples=max(1, budget - len(hard)), database=None)
    @given(case=cases(recipe.factory))
    def draw(case):
        drawn.append(case)

    with_corners(draw, hard)()
    assert len(drawn) >= budget >= 3 and drawn[0] == hard[0]
    packed = []
    for case in drawn:
        xa, ya = windows_case(recipe.factory, case).batches(recipe.factory)[0]
        packed.append(int((verify.data.count_documents(xa, ya) > 1).sum()))
    assert packed[0] > 0 and sum(p > 0 for p in packed) >= len(packed) // 2, packed
    xa, ya = windows_case(recipe.factory, hard[0]).batches(recipe.factory)[0]
    assert int(verify.data.count_documents(xa[:1], ya[:1])) > 1
    if profile == "dev":  # the gate itself once, on the corner (the same under every profile)
        assert check_normaliser(recipe.factory, hard[0]).extra["halved_packed"]


def test_segments_default_to_the_sequences_callables_own_and_must_be_callable():
    assert verify.Objective(sequences=verify.data.count_documents).segments is verify.data.documents
    assert verify.Objective(sequences=_count_without_segments).segments is None
    assert "segments" not in recipe.objective.declared()  # the default is not a declaration of its own
    with pytest.raises(verify.AdapterError, match="Objective.segments must be callable"):
        verify.Objective(sequences=verify.data.count_documents, segments=3)


class _NoRestartEverywhere(recipe.Trainer):
    """Attention across the pack on EVERY rank: a different model, the same one in every split."""

    def __init__(self, spec):
        super().__init__(spec)
        self.model = pa.NoRestartLM().to(spec.device, spec.dtype)  # the same seed: the same initial weights
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)


def test_a_mask_that_ignores_the_restarts_everywhere_is_no_accumulation_bug():
    """What no accumulation gate can see, said by a test: the wrong mask changes the loss's values, but every split
    of every window computes the same wrong function (its per-document mean still adds up). Only on rank > 0
    (rank_mask_no_restart, the data-parallel gate) does it break an invariant: rank 0 vs rank 1."""
    from verify._internal.gates import check_equivalence

    a = verify.adapter(data=recipe.factory.data, ignore_index=IGNORE, objective=recipe.objective)(_NoRestartEverywhere)
    assert check_normaliser(a, PACKED).ratio < 1 and check_equivalence(a, PACKED).ratio < 1
    assert check_normaliser(pa.rank_mask_no_restart, PACKED).ratio < 1  # one process: rank 0's model, correct
