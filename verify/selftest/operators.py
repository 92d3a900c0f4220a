"""Fault operators: each wraps ANY trainer behind the protocol (its four methods, the Spec, the batches, grads())
and plants one accumulation bug, without knowing its internals:
    accumulation   drop_micro_step, repeat_micro_step, grads_times_N, grads_over_N, optimizer_step_every_micro,
                   zero_grad_in_micro_loop, stale_micro_batch, loss_sum_not_mean, extra_collective_micro_0,
                   divide_by_world_twice, low_precision_accumulation
    tokens         per_micro_mean, count_from_first_micro, per_rank_mean, all_positions, sequences
    objectives     normaliser_applied_twice, aux_reset_per_micro; uneven windows: equal_rank_weights
    metrics        grad_norm_{one_shard,last_micro,post_clip,zero,per_rank}, lr_previous_step, count_one_micro, loss_last_micro
    fp16 / mesh    skip_decided_on_one_rank; pipeline_micro_batch_dropped, dp_reduction_skipped, reduced_over_wrong_group
`exists(case)`, `applies(adapter)`: where a kill is required; docs/design/self-test.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from verify._internal.metrics import max_norm_of
from verify._internal.protocol import AUTOCAST
from verify.selftest.mesh_ops import feed_micro_1_for_0, interposed
from verify.selftest.metric_ops import world as _world
from verify.selftest.mutant import Mutant
from verify.selftest.objective_ops import batch_term, count_again, micro_weights_differ, per_micro_aux, reset_per_micro
from verify.selftest.uneven_ops import equal_rank_weights, uneven_counts
from verify.selftest.metric_ops import last_micro_alone, one_micro_count, post_clip, previous_lr, set_metric, shard_norm

__all__ = ["Operator", "OPERATORS"]


@dataclass(frozen=True)
class Operator:
    name: str
    doc: str
    exists: Callable  # (case) -> bool
    inner_accum: Callable = lambda n: n
    micro: Callable = lambda w, x, y, m: w.inner.micro_step(x, y, m)
    scale: Callable | None = None  # (wrapper) -> factor applied in place to the boundary gradients
    loss: Callable = lambda w, loss: loss
    dist_only: bool = False
    at_n1: bool = False
    """Whether the fault acts at accum_steps=1. Most do not (there is nothing to accumulate), so the
    big-batch reference (the same adapter at N=1) stays the unmutated trainer."""
    replace_grads: Callable | None = None  # (wrapper, grads) -> None: writes the boundary gradients itself
    aux: bool = False  # the wrapper builds a second trainer (accum_steps=1) to read micro-batches alone
    long: bool = False
    """The fault shows only in long low-precision windows: the self-test runs it on its long-window case
    alone (selftest_cases), where the other operators do not run."""
    fp16: bool = False
    """The bug lives on the overflow path: it exists only for an adapter the overflow gate can run on (fp16
    and a way to overflow: verify._internal.gates.overflow.overflow_hook)."""

    mesh: bool = False  # runs on the self-test's mesh cases (verify._internal.gates.mesh), and only there
    metrics: Callable | None = None  # (wrapper, reported dict) -> the dict metrics() returns instead
    metric: str = ""
    """The reported metric the bug is in: it exists only for an adapter whose Metrics declare it (`applies`)."""
    around: Callable | None = None  # (wrapper) -> context manager entered around every call into the trainer
    batch_term: bool = False  # the bug is in a declared window-level `batch` term: exists only where one is declared
    unequal_micro: bool = False  # a mean of micro-batch means: a bug only where micro-batches weigh unequally
    clips: bool = False  # the bug is in what clipping did: it exists only where the adapter clips (its defaults')

    def __reduce__(self):
        # by name: the table's lambdas do not pickle, and a pool rank finds the same operator in OPERATORS
        return _operator, (self.name,)

    def applies(self, adapter) -> bool:
        """Whether the bug can exist for this adapter at all (a metrics operator: its metric is declared, in the
        convention it breaks)."""
        m = adapter.metrics
        if self.batch_term:
            return batch_term(adapter.objective) is not None
        if self.clips and max_norm_of(m, adapter.defaults) is None:  # no clipping: the norm after is the norm before
            return False
        if self.unequal_micro and not micro_weights_differ(adapter.objective):
            return False
        if not self.metric:
            return True
        if m is None:
            return False
        name, _, convention = self.metric.partition(":")
        names = ("tokens", "rows") if name == "counts" else (name,)
        if not any(n in m.names for n in names):
            return False
        field = {"tokens": "counts", "rows": "counts"}.get(name, name)
        return not convention or getattr(m, field, None) == convention or (convention == "max_norm" and m.max_norm is not None)

    def apply(self, adapter):
        """The adapter with this fault planted around its factory (pools rebuild it by name)."""
        inner, ignore, declared, objective = adapter.factory, adapter.ignore_index, adapter.metrics, adapter.objective

        def mutant_factory(spec):
            if spec.accum_steps > 1 or self.at_n1:
                return Mutant(self, inner, spec, ignore, declared, objective)
            return inner(spec)

        return adapter.replace(factory=mutant_factory, ref=adapter.locate(), mutation=self,
                               name=f"{adapter.name} ⊕ {self.name}")


def _drop(w, x, y, m):
    if m > 0:
        w.inner.micro_step(x, y, m - 1)


def _repeat(w, x, y, m):
    if m == 0:
        w.inner.micro_step(x.clone(), y.clone(), 0)
    w.inner.micro_step(x, y, m + 1)


def _every_micro(w, x, y, m):
    w.inner.micro_step(x, y, 0)
    if m < w.N - 1:
        w.inner.optimizer_step()


def _last_only(w, x, y, m):
    if m == w.N - 1:
        w.inner.micro_step(x, y, 0)


def _stale(w, x, y, m):
    prev = w._stale
    if m == w.N - 1:
        w._stale = (x.clone(), y.clone())
    if m == 0 and prev is not None:
        x, y = prev
    w.inner.micro_step(x, y, m)


def _extra_collective(w, x, y, m):
    w.inner.micro_step(x, y, m)
    import torch.distributed as dist

    if m == 0 and m < w.N - 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(torch.zeros(1, device=x.device))


def _per_micro(w, x, y, m):
    """The inner trainer accumulates as usual (its loss, state and traffic stay real); the aux trainer, at the
    inner trainer's parameters (written into the tensors params() returns), gives micro-batch m's own mean."""
    w.inner.micro_step(x, y, m)
    with torch.no_grad():
        theirs = w.aux.params()
        for k, p in w.inner.params().items():
            theirs[k].copy_(p)
    w.aux.micro_step(x.clone(), y.clone(), 0)
    w.micro_grads.append({k: g.detach().clone() for k, g in w.aux.grads().items() if g is not None})
    w.micro_losses.append(float(w.aux.optimizer_step()))  # NaN for a micro-batch without a valid target


def _own_gradient(w, x, y, m) -> tuple[dict, float]:
    """Micro-batch m's own gradient (the aux trainer at the inner trainer's parameters, one micro-step) and
    its weight in the window: its valid targets (adapters with an ignore_index), else 1 (equal micro-batches
    of a mean loss)."""
    with torch.no_grad():
        theirs = w.aux.params()
        for k, p in w.inner.params().items():
            theirs[k].copy_(p)
    w.aux.micro_step(x.clone(), y.clone(), 0)
    g = {k: v.detach().clone() for k, v in w.aux.grads().items() if v is not None}  # its step clips in place
    c = float((y != w.ignore).sum()) if w.ignore is not None else 1.0
    w.aux.optimizer_step()
    return g, c


def _low_precision_micro(w, x, y, m):
    """The inner trainer runs as usual (its loss, state, traffic); micro-batch m's own gradient, weighted, is
    added into a running sum rounded to bf16 / fp16 after every micro-step: the accumulator of a trainer
    whose `.grad` lives in the autocast dtype (fp32 runs, the float64 references among them, are left alone)."""
    w.inner.micro_step(x, y, m)
    if w.precision not in AUTOCAST:  # fp32
        return
    g, c = _own_gradient(w, x, y, m)
    low = AUTOCAST[w.precision]
    w.low_sum = {} if w.low_sum is None else w.low_sum
    with torch.no_grad():
        for k, v in g.items():  # a micro-batch without a valid target may bring no gradient at all
            w.low_sum[k] = ((w.low_sum[k].float() if k in w.low_sum else 0.0) + c * v.float()).to(low)
    w.low_weight += c


def _low_precision_sum(w, grads: dict) -> None:
    with torch.no_grad():
        for k, g in grads.items():
            if w.low_sum is not None and k in w.low_sum and w.low_weight:
                g.copy_(w.low_sum[k].to(g.dtype) / w.low_weight)


def _mean_of_micro_means(w, grads: dict) -> None:
    """The boundary gradient becomes the mean over micro-steps of each micro-batch's own token mean (a
    micro-batch without a valid target adds 0, as a NaN-free per-micro-batch mean does)."""
    with torch.no_grad():
        for k, g in grads.items():
            g.copy_(sum((mg[k] for mg in w.micro_grads if k in mg), torch.zeros_like(g)) / w.N)


def _micro_mean_loss(w, loss):
    vals = [v for v in w.micro_losses if v == v]
    return torch.full_like(torch.as_tensor(loss), sum(vals) / w.N if vals else float("nan"))


def _ratio(num, den) -> float:
    return num / den if den else float("inf")  # a count of 0 divides by zero: the gradient blows up


def _count_factor(which):
    """Boundary factor that turns Σ / (the window's valid count) into Σ / which(counts, wrapper)."""
    def scale(w):
        c = w.window_counts()
        return _ratio(c[0], which(c, w)) if c[0] else 1.0  # an empty window: nothing to divide
    return scale


def _one_rank_factor(w):
    c = w.window_counts()
    return _ratio(c[0], _world() * w.counts[0]) if c[0] else 1.0


def _seen_non_finite(w, grads: dict) -> None:
    """Reads the boundary gradient (changes nothing): did the window overflow, on any rank?"""
    w.non_finite = any(not bool(torch.isfinite(g).all()) for g in grads.values())


def _step_anyway(w, loss):
    """After the inner trainer's (correct) skip: on ranks ≥ 1, an overflowing window is stepped regardless.
    The wrapper cannot reach the inner optimizer, so its "step" is a weight-decay-like shrink (× (1 - 1e-3))
    written into the tensors params() returns: which update does not matter, that those ranks move does."""
    import torch.distributed as dist

    if getattr(w, "non_finite", False) and _world() > 1 and dist.get_rank() > 0:
        with torch.no_grad():
            for p in w.inner.params().values():
                p.mul_(1.0 - 1e-3)
    w.non_finite = False
    return loss


N2 = lambda c: c.accum_steps >= 2  # noqa: E731


def _windows(c) -> list[list[list[list[int]]]]:
    """Padded case -> per step, per global micro-batch, per rank: the rows' valid-target counts (the layout
    of verify._internal.cases.case.shard; on an uneven window a rank past its last micro-step holds none)."""
    out = []
    for k in range(c.steps):
        pos, step = k * c.effective_batch, [[[] for _ in range(c.world)] for _ in range(c.accum_steps)]
        for m, r, rows in c.layout():
            step[m][r], pos = list(c.lengths[pos:pos + rows]), pos + rows
        out.append(step)
    return out


def _shows(c, differs) -> bool:
    """The case is padded and some step holds valid targets where `differs(step)` says the count is wrong."""
    return c.lengths is not None and any(sum(map(sum, sum(s, []))) and differs(s) for s in _windows(c))


def _micro_counts(s):
    return [sum(map(sum, m)) for m in s]


PADDED = lambda c: _shows(c, lambda s: True)  # noqa: E731
UNEVEN_MICRO = lambda c: N2(c) and _shows(c, lambda s: len(set(_micro_counts(s))) > 1)  # noqa: E731
FIRST_MICRO = lambda c: N2(c) and _shows(c, lambda s: sum(_micro_counts(s)) != len(s) * _micro_counts(s)[0])  # noqa: E731
UNEVEN_RANKS = lambda c: c.world >= 2 and _shows(  # noqa: E731
    c, lambda s: len({sum(sum(m[r]) for m in s) for r in range(c.world)}) > 1)

def _operator(name: str) -> Operator:
    return OPERATORS[name]


OPERATORS = {op.name: op for op in [
    Operator("drop_micro_step", "micro-step 0 never reaches the trainer, which averages the other N-1", N2,
             inner_accum=lambda n: max(1, n - 1), micro=_drop),
    Operator("repeat_micro_step", "micro-step 0's batch runs twice (N+1 micro-steps)", N2,
             inner_accum=lambda n: n + 1, micro=_repeat),
    Operator("grads_times_N", "boundary gradients × N: the 1/N scale is missing", N2,
             scale=lambda w: float(w.N)),
    Operator("grads_over_N", "boundary gradients ÷ N: the 1/N scale is applied twice", N2,
             scale=lambda w: 1.0 / w.N),
    Operator("optimizer_step_every_micro", "the optimizer steps after every micro-step", N2,
             inner_accum=lambda n: 1, micro=_every_micro),
    Operator("zero_grad_in_micro_loop", "zero_grad inside the loop: only the last micro-batch counts", N2,
             inner_accum=lambda n: 1, micro=_last_only),
    Operator("stale_micro_batch", "micro-step 0 of step k gets step k-1's last micro-batch",
             lambda c: c.steps >= 2, micro=_stale, at_n1=True),
    Operator("loss_sum_not_mean", "the reported step loss is the sum of the N micro-losses", N2,
             loss=lambda w, loss: loss * w.N),
    Operator("extra_collective_micro_0", "one extra 1-element all_reduce on micro-step 0",
             lambda c: c.world >= 2 and c.accum_steps >= 2, micro=_extra_collective, dist_only=True),
    Operator("divide_by_world_twice", "boundary gradients ÷ W once more (/world applied twice)",
             lambda c: c.world >= 2, scale=lambda w: 1.0 / _world(), dist_only=True, at_n1=True),
    # -- precision: the self-test's long-window case only (operator.long) ------------------------------------
    Operator("low_precision_accumulation", "the window's gradient summed in bf16 / fp16 (the autocast dtype), "
             "rounded after every micro-step", lambda c: c.accum_steps >= 2 and c.precision != "fp32",
             micro=_low_precision_micro, scale=lambda w: 1.0, replace_grads=_low_precision_sum, aux=True, long=True),
    # -- token weighting ----------------------------------------------------------------------------------
    Operator("per_micro_mean", "each micro-batch's own token mean, averaged over the N micro-steps",
             lambda c: UNEVEN_MICRO(c) and c.world == 1, micro=_per_micro, scale=lambda w: 1.0,
             replace_grads=_mean_of_micro_means, loss=_micro_mean_loss, aux=True, unequal_micro=True),
    Operator("count_from_first_micro", "the window's valid count taken as N × micro-step 0's",
             FIRST_MICRO, scale=_count_factor(lambda c, w: w.N * c[3]),
             loss=lambda w, loss: loss * w.factor),
    Operator("per_rank_mean", "each rank takes the window's valid count as W × its own",
             UNEVEN_RANKS, scale=_one_rank_factor, loss=lambda w, loss: loss * w.factor,
             dist_only=True, at_n1=True),
    Operator("all_positions", "divided by every target position of the window, padding included",
             PADDED, scale=_count_factor(lambda c, w: c[1]), loss=lambda w, loss: loss * w.factor, at_n1=True),
    Operator("sequences", "divided by the window's number of sequences, not of valid targets",
             PADDED, scale=_count_factor(lambda c, w: c[2]), loss=lambda w, loss: loss * w.factor, at_n1=True),
    # -- declared objectives: a normaliser applied twice; a global-batch term computed per micro-batch ----------
    Operator("normaliser_applied_twice", "the window's gradient ÷ its count once more (valid targets, else rows)",
             N2, scale=count_again, loss=lambda w, loss: loss * w.factor),
    Operator("aux_reset_per_micro", "the batch term's counts reset every micro-step: its micro-batches' mean",
             lambda c: N2(c) and c.world == 1, micro=reset_per_micro, scale=lambda w: 1.0, replace_grads=per_micro_aux,
             batch_term=True),
    # -- uneven windows (Case.rank_rows): exists only on uneven cases whose ranks hold different counts -----------
    Operator("equal_rank_weights", "the ranks' own means averaged equally (÷ W), whatever each rank holds",
             uneven_counts, around=equal_rank_weights, dist_only=True, at_n1=True),
    # -- what metrics() reports: exists only where the adapter declares the metric (Operator.applies) ----------
    Operator("grad_norm_one_shard", "grad_norm over every other parameter (one rank's shard, never reduced)", N2,
             metrics=shard_norm, metric="grad_norm:pre_clip"),
    Operator("grad_norm_last_micro", "grad_norm of the last micro-batch's own gradient",
             lambda c: N2(c) and c.world == 1, micro=last_micro_alone, aux=True, metric="grad_norm:pre_clip",
             metrics=set_metric("grad_norm", lambda w, out: w.last["own_last"][0])),
    Operator("grad_norm_post_clip", "grad_norm after clipping, declared before", N2, metrics=post_clip,
             metric="grad_norm:pre_clip", clips=True),
    Operator("grad_norm_zero", "grad_norm read after the gradients were freed: 0", N2,
             metrics=set_metric("grad_norm", lambda w, out: 0.0), metric="grad_norm"),
    Operator("grad_norm_per_rank", "grad_norm with every replicated element counted once per rank (×√W)",
             lambda c: c.world >= 2, metrics=set_metric("grad_norm", lambda w, out: out["grad_norm"] * _world() ** 0.5),
             metric="grad_norm", dist_only=True, at_n1=True),
    Operator("lr_previous_step", "lr of the previous step (read on the wrong side of the scheduler's step)",
             lambda c: c.steps >= 2, metrics=previous_lr, metric="lr", at_n1=True),
    Operator("count_one_micro", "tokens / rows of the last micro-step only", N2, metrics=one_micro_count,
             metric="counts:global"),
    Operator("loss_last_micro", "loss of the last micro-batch logged as the window's",
             lambda c: N2(c) and c.world == 1, micro=last_micro_alone, aux=True, metric="loss:window",
             metrics=set_metric("loss", lambda w, out: w.last["own_last"][1])),
    # -- fp16 overflow -------------------------------------------------------------------------------------
    Operator("skip_decided_on_one_rank", "ranks ≥ 1 never see an overflow: they step an overflowing window",
             lambda c: c.world >= 2, scale=lambda w: 1.0, replace_grads=_seen_non_finite, loss=_step_anyway,
             dist_only=True, at_n1=True, fp16=True),
    # -- mesh: the self-test's mesh cases (adapters with mesh_axes) ------------------------------------------
    Operator("pipeline_micro_batch_dropped", "micro-batch 0 never reaches the trainer; micro-batch 1 runs in its place",
             N2, micro=feed_micro_1_for_0, mesh=True),
    Operator("dp_reduction_skipped", "torch.distributed's reductions on the dp group do nothing",
             lambda c: c.mesh.dp >= 2, around=lambda w: interposed(w, swap=False), mesh=True),
    Operator("reduced_over_wrong_group", "the dp group's reductions run on the tp group (no tp: the whole world)",
             lambda c: c.mesh.dp >= 2 and c.mesh.size > c.mesh.dp, around=lambda w: interposed(w, swap=True), mesh=True),
]}
