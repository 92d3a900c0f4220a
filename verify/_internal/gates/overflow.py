"""Injected overflow (fp16): the inf-handling path of a GradScaler trainer, which the other gates never reach.

K ≥ 2 windows under fp16 on W ranks; in window 0 ONE micro-step on ONE rank overflows — injected by the
harness (BackwardInf: an inf in the first module output's gradient backward reaches) unless the adapter's
`overflow` hook does it — and the big batch gets the same injection. Exact verdicts: skip (window 0 leaves
every rank's and the big batch's parameters bit-unchanged), scale (with `loss_scale()`: one update per
window, equal to the big batch's), ranks (bit-equal to rank 0 after every window). Failures are
GateFailure(gate=Gate.OVERFLOW) naming the window, the rank and where the overflow was.

Design: docs/design/numerics.md, "Injected overflow".
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from verify._internal.cases.case import Case, shard
from verify._internal.ranks.pool import get_pool
from verify._internal.verdict import Gate, GateFailure, GateResult, GateSkipped

__all__ = ["check_overflow", "overflow_hook", "overflow_job", "BackwardInf", "GATE"]

GATE = Gate.OVERFLOW


class BackwardInf:
    """The harness's own injection, armed around one micro-step (until it fires): a process-wide module
    forward hook puts a one-shot hook on every floating module output that requires grad; the first of those
    that backward reaches puts an inf into its gradient (at the overflowing rows' first element, where the
    output is rows first) and disarms all. Module outputs, not trainer.params(): those may be copies (FSDP's
    full tensors, a framework's views) whose hooks never fire, while every model's backward passes through a
    module. Inputs are not scaled: token ids cannot be, and a normalising first layer would undo it."""

    def __init__(self, rows: slice, n_rows: int):
        self.rows, self.n_rows, self.fired, self._handle = rows, n_rows, False, None

    def arm(self) -> "BackwardInf":
        from torch.nn.modules.module import register_module_forward_hook

        self._handle = register_module_forward_hook(self._forward)
        return self

    def disarm(self) -> bool:
        """Removes the forward hook (idempotent); True when the inf went into a gradient."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        return self.fired

    def _forward(self, module, args, output):
        if torch.is_tensor(output) and output.is_floating_point() and output.requires_grad and not self.fired:
            output.register_hook(self._backward)

    def _backward(self, g):
        if self.fired:
            return None
        self.fired = True
        self.disarm()
        if type(g) is not torch.Tensor:  # a DTensor / subclass: no element indexing, every element inf
            return g + float("inf")
        g = g.clone()
        lead = (self.rows.start or 0) if g.dim() and g.shape[0] == self.n_rows else 0
        g[(lead,) + (0,) * (g.dim() - 1) if g.dim() else ()] = float("inf")
        return g


def overflow_hook(adapter):
    """How the gate overflows one micro-batch of the adapter: its own `overflow` hook, else BackwardInf
    (the harness's, any inputs); None (with why) when the adapter has no fp16."""
    if "fp16" not in adapter.precisions:
        return None, f"{adapter.name} does not declare fp16 (numerics=verify.Numerics(precisions=...)): no loss scaling to overflow"
    return (adapter.overflow if adapter.overflow is not None else BackwardInf), ""


def _copy(d: dict) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in d.items()}


def _run(trainer, batches, N: int, rank: int, world: int, device, hook, at: tuple[int, slice] | None) -> dict:
    """The harness's loop (as verify._internal.cases.case.drive) with the overflow hook applied to window 0's micro-step
    at[0], rows at[1] of it. Returns params before / after every window and the loss scale after each."""
    scale = getattr(trainer, "loss_scale", None)
    out = dict(params=[_copy(trainer.params())], scale=[scale() if scale else None], losses=[], fired=None)
    shot = None
    try:
        for k, (inputs, targets) in enumerate(batches):
            for m, (x, y) in enumerate(shard(inputs, targets, N, rank, world)):
                x = x.to(device=device, dtype=torch.float32 if x.is_floating_point() else x.dtype)
                x, y = x.clone(), y.to(device).clone()
                if k == 0 and at is not None and m == at[0]:
                    if hook is BackwardInf:  # armed until its backward (a framework's loop may run it later)
                        shot = BackwardInf(at[1], len(x)).arm()
                    else:
                        x, y = hook(trainer, x, y, at[1])
                trainer.micro_step(x, y, m)
            trainer.grads()
            if k == 0 and shot is not None:
                out["fired"] = shot.disarm()
            out["losses"].append(float(trainer.optimizer_step()))
            out["params"].append(_copy(trainer.params()))
            out["scale"].append(scale() if scale else None)
    finally:  # a process-wide hook never outlives its run
        if shot is not None:
            shot.disarm()
    return out


def overflow_job(ctx, adapter, case: Case, micro: int, rank: int, reference: bool = False) -> dict:
    """On every rank of a pool: the fp16 trainer over the case's windows, window 0's micro-step `micro` on
    rank `rank` overflowing. reference=True (a one-rank pool): the big batch, the same rows overflowing."""
    hook, why = overflow_hook(adapter)
    batches = case.batches(adapter)
    B, W = case.micro_batch, case.world
    if reference:
        row = (micro * W + rank) * B  # verify._internal.cases.case.shard's layout: global micro-batch m, rank r's rows
        N, at, world, me = 1, (0, slice(row, row + B)), 1, 0
    else:
        N, at, world, me = case.accum_steps, ((micro, slice(None)) if ctx.rank == rank else None), W, ctx.rank
    trainer = adapter(case.spec(accum_steps=N, device=str(ctx.device), adapter=adapter, group=ctx.group))
    return _run(trainer, batches, N, me, world, ctx.device, hook, at)


def _diff(a: dict, b: dict) -> str | None:
    for name, t in b.items():
        if name not in a or not torch.equal(a[name], t):
            return name
    return None


def check_overflow(adapter, case: Case, micro: int, rank: int, *, pool=None, ref_pool=None) -> GateResult:
    """The injected-overflow verdict on one case (precision fp16, steps ≥ 2), window 0 overflowing at
    (`micro`, `rank`). GateSkipped where the adapter has no fp16 or no way to overflow."""
    hook, why = overflow_hook(adapter)
    if hook is None:
        raise GateSkipped(why)
    if case.world > 1 and not adapter.data_parallel:
        raise GateSkipped(f"{adapter.name} does not declare data parallelism (distributed=verify.Distributed(data_parallel=True))")
    if case.precision != "fp16" or case.steps < 2 or not (0 <= micro < case.accum_steps and 0 <= rank < case.world):
        raise ValueError(f"the overflow gate needs precision fp16, steps ≥ 2 and micro < N, rank < W; got {case} "
                         f"micro={micro} rank={rank}")
    if 0 in case.empty_steps():  # no valid target: nothing is backwarded, an armed hook would fire in window 1
        raise ValueError(f"the overflow gate needs a window 0 with a valid target; got {case}")
    if case.world == 1 and not adapter.process_group and pool is None:  # one process: here, on case.device
        here = SimpleNamespace(rank=0, world=1, device=torch.device(case.device), group=None)
        ref = overflow_job(here, adapter, case, micro, rank, True)
        runs = [overflow_job(here, adapter, case, micro, rank)]
    else:
        pool = pool or get_pool(case.world, subgroups=adapter.subgroups)
        ref_pool = pool if case.world == 1 else (ref_pool or get_pool(1))
        ref = ref_pool.run(overflow_job, adapter, case, micro, rank, True)[0]
        runs = pool.run(overflow_job, adapter, case, micro, rank)
    where = f"window 0 overflows in micro-step {micro} of {case.accum_steps} on rank {rank} of {case.world}"
    if any(run["fired"] is False for run in (ref, *runs)):  # the harness's injection saw no backward there
        raise GateSkipped(f"{adapter.name}: no backward through a floating module output that requires grad in the "
                          f"overflowing micro-step ({where}), so the harness could not inject the overflow; declare "
                          f"numerics=verify.Numerics(overflow=...) to make one micro-batch overflow fp16")

    def fail(msg):
        raise GateFailure(f"[{GATE}] {msg} ({where}); case {case}", gate=GATE, case=case)

    for r, run in enumerate(runs):  # the skip, rank by rank: named before the big batch is looked at
        name = _diff(run["params"][1], run["params"][0])
        if name is not None:
            fail(f"rank {r}, window 0: parameter {name!r} changed — a window with an overflow anywhere (any "
                 f"micro-step, any rank) must be skipped whole, on every rank")
    if _diff(ref["params"][1], ref["params"][0]) is not None:
        fail("the big batch (N=1, one rank) holding the overflowing rows stepped: the injected overflow did not "
             "make the adapter at N=1 skip its step (does its overflow hook make the fp16 forward or gradient "
             "non-finite?)")
    for k in range(1, case.steps + 1):
        for r, run in enumerate(runs):
            got, want = run["scale"][k], ref["scale"][k]
            if got is not None and got != want:
                fail(f"rank {r}, window {k - 1}: loss scale {got:g} after the window, the big batch's {want:g} after "
                     f"its one step — the scale must be updated once per window (scale before: {run['scale'][k - 1]:g})")
            if r:
                name = _diff(run["params"][k], runs[0]["params"][k])
                if name is not None:
                    fail(f"rank {r}, window {k - 1}: parameter {name!r} differs from rank 0's — ranks diverged "
                         f"(the skip, and the optimizer state it must leave alone, decided alike on every rank)")
    scale = runs[0]["scale"]
    worst = (f"skipped on all {case.world} rank(s); " +
             (f"loss scale {scale[0]:g} -> {scale[1]:g}, as the big batch's" if scale[0] is not None
              else "no loss_scale() to compare"))
    return GateResult(GATE, case, worst, 0.0)
