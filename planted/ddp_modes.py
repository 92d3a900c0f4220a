"""torch DistributedDataParallel's options as adapters, each with the count table row of its sync mode.

Small MLP regressors in the style of examples/ddp_no_sync.py (data `verify.data.regression(features=8)`,
AdamW, `no_sync()` around the forward AND backward of micro-steps 0..N-2, the step loss a global mean
through one all-reduce in optimizer_step()). One module-level adapter per mode, `MODES[mode]`:

mode          DDP option, and its count table row (world ≥ 2;  what torch 2.13 does (CPU, gloo, worlds 2-3)
              P = parameter elements; elements = floating
              elements reduced at the boundary)
------------  -----------------------------------------------  ----------------------------------------------
bucket_view   DDP(gradient_as_bucket_view=True)                syncs only at the boundary; the one-time
              before: none                                     bucket rebuild (2 int32 broadcasts) at
              boundary: all_reduce × 2 (1 bucket + the loss)   micro-step 0 of step 1
              elements: P+1 (P = 321)
              expected: DDP_EXPECTED
static_graph  DDP(static_graph=True)                           no_sync() on the module's very FIRST backward
              before: none                                     fails an internal assert (reducer.cpp,
              boundary: all_reduce × 2                         expect_autograd_hooks_); after one synced
              elements: P+1                                    warm-up it syncs at every boundary, never
              first micro-step: + all_reduce × 2 if N > 1      before (the report that it stops all-reducing
              (the warm-up: int32 used-map + float bucket),    after iteration 1 does not reproduce); it
              + all_reduce × 1 if N = 1 (the int32 map rides   rebuilds its buckets after its 2nd synced
              the first synced backward)                       backward
              expected: STATIC_EXPECTED (the rebuild at
              micro-step 0 of step 1 if N > 1, of step 2 if
              N = 1)
find_unused   DDP(find_unused_parameters=True), a router       syncs only at the boundary; never rebuilds.
              before: none                                     The gradient of an expert used only in
              boundary: all_reduce × 3 (bucket + the int32     no_sync micro-steps, or only on some ranks, is
              unused-parameter bitmap + the loss)              right; an expert no rank used keeps grad None,
              elements: P+1 (P = 609)                          as in the big batch
              expected: none
compiled      torch.compile(DDP(m), backend="aot_eager")       syncs only at the boundary (the "compiled
              row: as bucket_view                              module ignores no_sync" report, pytorch
                                                               #109774, does not reproduce); DDP's own
                                                               forward is not traced, dynamo compiles the
                                                               wrapped module's forward

Why each is built the way it is:
* the model is a class with its own `forward` (not an `nn.Sequential`): torch.compile of a DDP module
  starts tracing at the wrapped module's frame, and torch.nn's own modules are in dynamo's skip list —
  `torch.compile(DDP(nn.Sequential(...)))` compiled no graph at all on torch 2.13 (everything ran eagerly).
  The compiled trainer counts eager forwards and fails its step if one happens (a silent fallback to
  eager would make the mode prove nothing).
* static_graph runs one synchronized forward+backward of `loss * 0` before its first micro-step when
  N > 1 (see StaticGraph).
* find_unused computes each expert only on its own rows (an expert with no rows is not in the graph);
  the per-row function does not depend on the batch, so the big-batch reference is well defined.
* grads() reports a parameter whose grad is None (an expert nobody used) as zeros; the reference does
  the same, and AdamW skips it in both.

Planted bugs (registered in planted.py): the no_sync context around backward only, in the find_unused and compiled modes
(DDP arms its reducer at forward: both sync every micro-step), and find_unused checked against
bucket_view's row (the int32 bitmap undeclared), bucket_view with head.bias left out of DDP (every count
right, the payload 1 element short: the row's element bound); a router that loses what an expert accumulated before
the sync micro-step when that micro-step does not use it (caught by the equivalence gate); a "compiled"
trainer running eagerly (its own check fails the step).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from verify.data import regression
from verify import DDP_EXPECTED, Adapter, CountRow, Expected

__all__ = ["MODES", "MLP", "Router", "first_backward_under_no_sync", "compiled_graphs"]

FEATURES, HIDDEN = 8, 32
P_MLP = FEATURES * HIDDEN + HIDDEN + HIDDEN + 1  # 321 parameter elements
P_ROUTER = 2 * (FEATURES * HIDDEN + HIDDEN) + HIDDEN + 1  # 609
DATA = regression(features=FEATURES)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(FEATURES, HIDDEN), nn.Linear(HIDDEN, 1)
        self.eager_forwards = 0

    def forward(self, x):
        if not torch.compiler.is_compiling():  # dead code in a compiled graph: counts eager runs only
            self.eager_forwards += 1
        return self.head(torch.tanh(self.fc(x)))


class Router(nn.Module):
    """Each row goes to expert a if x[:, 0] > 0, else to expert b; a shared head. An expert runs on its
    rows only: with no rows it is not in the autograd graph at all (DDP's find_unused sees it unused)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, 1)
        self.used: tuple = ()  # the experts of the last forward

    @staticmethod
    def route(x) -> dict:
        to_a = x[:, 0] > 0
        return {"a": to_a.nonzero().squeeze(1), "b": (~to_a).nonzero().squeeze(1)}

    def forward(self, x):
        parts, rows, used = [], [], []
        for name, idx in self.route(x).items():
            if idx.numel():
                parts.append(getattr(self, name)(x[idx]))
                rows.append(idx)
                used.append(name)
        self.used = tuple(used)
        return self.head(torch.cat(parts)[torch.cat(rows).argsort()])


class _Trainer:
    ddp_kwargs: dict = {}
    net = MLP
    ignored: tuple = ()  # parameter names DDP is told to leave alone (a planted bug below)

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.model = self.net().to(spec.device, spec.dtype)
        if self.ignored:
            DDP._set_params_and_buffers_to_ignore_for_model(self.model, list(self.ignored))
        self.ddp = DDP(self.model, device_ids=None if spec.device == "cpu" else [spec.device], **self.ddp_kwargs)
        self.forward = self.ddp
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-2)
        self.n, self.loss = spec.accum_steps, 0.0

    def sync(self, micro):
        """DDP decides at FORWARD whether the coming backward all-reduces: the context covers both."""
        return self.ddp.no_sync() if micro < self.n - 1 else contextlib.nullcontext()

    def micro_step(self, x, y, micro):
        with self.sync(micro):
            loss = F.mse_loss(self.forward(x), y)
            (loss if self.n == 1 else loss / self.n).backward()
        self.loss = self.loss + loss.detach()

    def grads(self):
        return {k: torch.zeros_like(p) if p.grad is None else p.grad for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss, self.loss = self.loss / (self.n * dist.get_world_size()), 0.0
        dist.all_reduce(loss)  # the global batch's mean loss (every rank holds equal micro-batches)
        return loss

    def params(self):
        return dict(self.model.named_parameters())


class BucketView(_Trainer):
    ddp_kwargs = dict(gradient_as_bucket_view=True)


class StaticGraph(_Trainer):
    """Why the warm-up: with static_graph=True, DDP records the graph during the module's FIRST backward,
    and on torch 2.13 a first backward under no_sync() fails `expect_autograd_hooks_ INTERNAL ASSERT FAILED
    at reducer.cpp` (test_static_graph_first_backward_under_no_sync_raises). So when micro-step 0 would run
    under no_sync (N > 1), the trainer first runs ONE synchronized forward+backward of `loss * 0` on that
    micro-batch: every gradient is exactly 0 (and all-reduced zeros stay 0), the real micro-step adds to it
    unchanged. Its collectives (an int32 used-parameter map and one float bucket all-reduce) are declared
    in the row's first_micro. At N = 1 no no_sync is ever used and there is no warm-up."""

    ddp_kwargs = dict(static_graph=True)
    warm = False

    def micro_step(self, x, y, micro):
        if not self.warm and self.n > 1:
            (F.mse_loss(self.forward(x), y) * 0).backward()
        self.warm = True
        super().micro_step(x, y, micro)


class FindUnused(_Trainer):
    ddp_kwargs = dict(find_unused_parameters=True)
    net = Router


class Compiled(_Trainer):
    """torch.compile of the DDP module: forward through the compiled module, no_sync on the DDP module."""

    def __init__(self, spec):
        super().__init__(spec)
        self.forward = torch.compile(self.ddp, backend="aot_eager")

    def optimizer_step(self):
        if self.model.eager_forwards:
            raise RuntimeError(f"compiled mode: the model ran {self.model.eager_forwards} forward(s) eagerly — "
                               f"torch.compile compiled nothing (or fell back), so this run proves nothing about it")
        return super().optimizer_step()


# -- count table rows ----------------------------------------------------------------------------

def _row(mode: str, P: int, boundary: int, first: dict | None = None) -> CountRow:
    # elements: the gradient once (one bucket of P) + the 1-element loss all-reduce, exactly
    return CountRow(mode, before={}, boundary={"all_reduce": boundary}, elements=(P + 1, P + 1),
                    first_micro=first or {})


def bucket_view_row(case) -> CountRow:
    return _row("bucket_view", P_MLP, 2)  # the model (1.3 KiB) fits DDP's first 1 MiB bucket: 1 + the loss


def static_graph_row(case) -> CountRow:
    return _row("static_graph", P_MLP, 2, {"all_reduce": 2 if case.accum_steps > 1 else 1})


def find_unused_row(case) -> CountRow:
    return _row("find_unused", P_ROUTER, 3)  # the bucket, the int32 unused-parameter bitmap, the loss


def compiled_row(case) -> CountRow:
    return _row("compiled", P_MLP, 2)


# static_graph rebuilds its buckets in the forward after its SECOND synchronized backward: with the
# warm-up (N > 1) that is micro-step 0 of step 1; without it (N = 1) micro-step 0 (= the boundary) of step 2.
STATIC_EXPECTED = (
    Expected("broadcast", count=2, dtype="integer", step=1, micro=0,
             why="DDP static_graph bucket rebuild (N > 1: after the warm-up and step 0's boundary)"),
    Expected("broadcast", count=2, dtype="integer", step=2, micro=0,
             why="DDP static_graph bucket rebuild (N = 1: after steps 0 and 1)"),
)


def _adapter(cls, row, expected, name) -> Adapter:
    return Adapter(factory=cls, data=DATA, process_group=True, expected=expected, counts=row, name=name)


bucket_view = _adapter(BucketView, bucket_view_row, DDP_EXPECTED, "DDP gradient_as_bucket_view=True, no_sync()")
static_graph = _adapter(StaticGraph, static_graph_row, STATIC_EXPECTED, "DDP static_graph=True, no_sync()")
find_unused = _adapter(FindUnused, find_unused_row, (), "DDP find_unused_parameters=True router, no_sync()")
compiled = _adapter(Compiled, compiled_row, DDP_EXPECTED, "torch.compile(DDP) aot_eager, no_sync()")
MODES = {"bucket_view": bucket_view, "static_graph": static_graph, "find_unused": find_unused, "compiled": compiled}


# -- planted bugs --------------------------------------------------------------------------------

class _SyncAroundBackwardOnly:
    """`with ddp.no_sync(): loss.backward()` with the forward outside: DDP armed its reducer at the
    forward, so every micro-step all-reduces."""

    def micro_step(self, x, y, micro):
        loss = F.mse_loss(self.forward(x), y)
        with self.sync(micro):
            (loss if self.n == 1 else loss / self.n).backward()
        self.loss = self.loss + loss.detach()


class FindUnusedSyncAroundBackwardOnly(_SyncAroundBackwardOnly, FindUnused):
    pass


class CompiledSyncAroundBackwardOnly(_SyncAroundBackwardOnly, Compiled):
    pass


class RouterDropsStaleExpert(FindUnused):
    """Before the sync micro-step, drops what an expert accumulated if that micro-step does not route to
    it on this rank — what DDP would compute if it zeroed parameters unused in the sync iteration."""

    def micro_step(self, x, y, micro):
        if micro == self.n - 1:
            for name, idx in Router.route(x).items():
                if not idx.numel():
                    for p in getattr(self.model, name).parameters():
                        if p.grad is not None:  # (None would trip DDP's own check: used, yet undefined)
                            p.grad.zero_()
        super().micro_step(x, y, micro)


class CompiledRunsEager(Compiled):
    """What a silent fallback to eager looks like: the "compiled" trainer forwards through the DDP module
    itself. Its own check fails the step (the mode would otherwise pass, proving nothing about compile)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.forward = self.ddp


find_unused_sync_around_backward_only = _adapter(
    FindUnusedSyncAroundBackwardOnly, find_unused_row, (), "broken: find_unused, no_sync around backward only")
compiled_sync_around_backward_only = _adapter(
    CompiledSyncAroundBackwardOnly, compiled_row, DDP_EXPECTED, "broken: compiled, no_sync around backward only")
find_unused_with_plain_row = _adapter(
    FindUnused, bucket_view_row, DDP_EXPECTED, "broken: find_unused declared with bucket_view's row")
compiled_runs_eager = _adapter(CompiledRunsEager, compiled_row, DDP_EXPECTED, "broken: compiled mode running eagerly")


class BucketViewIgnoresHeadBias(BucketView):
    """head.bias left out of DDP (params_and_buffers_to_ignore, e.g. a stale "frozen" list): still one
    bucket and the loss at the boundary, so every count matches; the bucket is 1 element short, and only
    the row's element bound sees that before the ranks' head.bias drift apart."""
    ignored = ("head.bias",)


bucket_view_ignores_head_bias = _adapter(
    BucketViewIgnoresHeadBias, bucket_view_row, DDP_EXPECTED, "broken: bucket_view, DDP ignores head.bias")
router_drops_stale_expert = _adapter(
    RouterDropsStaleExpert, find_unused_row, (), "broken: router drops an expert's accumulated gradient")


class ReferenceSyncsEveryMicro(BucketView):
    """Its float64 reference syncs every micro-step (no no_sync), its float32 runs only at the boundary: a framework
    whose float64 path takes another mode (DeepSpeed runs float64 at another ZeRO stage), declared with that run's
    own row (Distributed.counts64: reference_every_micro_row); undeclared, the float64 run breaks bucket_view's row."""

    def sync(self, micro):
        return contextlib.nullcontext() if self.model.head.weight.dtype == torch.float64 else super().sync(micro)


def reference_every_micro_row(case) -> CountRow:
    return CountRow("every micro-step", before={"all_reduce": 1}, boundary={"all_reduce": 2}, elements=(P_MLP, P_MLP + 1))


# the rebuild follows the first synchronised backward: micro-step 0 of step 1 at the boundary mode, of step 0's
# micro-step 1 in the every-micro-step reference
REFERENCE_EXPECTED = DDP_EXPECTED + (Expected("broadcast", count=2, dtype="integer", step=0, micro=1,
                                              why="DDP's bucket rebuild after the reference's first synced backward"),)
reference_syncs_every_micro = Adapter(
    factory=ReferenceSyncsEveryMicro, data=DATA, process_group=True, expected=REFERENCE_EXPECTED, counts=bucket_view_row,
    counts64=reference_every_micro_row, name="DDP bucket_view, its float64 reference synced every micro-step")
reference_row_undeclared = reference_syncs_every_micro.replace(
    counts64=None, name="broken: the float64 reference's mode undeclared (bucket_view's row)")

# Which gate must reject each, and what its message must say (the row): planted.py.


# -- jobs the tests run on a rank pool -----------------------------------------------------------

def first_backward_under_no_sync(ctx, static: bool = True) -> str | None:
    """A fresh DDP(static_graph=static) module whose very first forward+backward runs under no_sync():
    None if it runs, else the error's first line."""
    torch.manual_seed(0)
    ddp = DDP(MLP().to(ctx.device), static_graph=static)  # NCCL: the module on the rank's GPU
    x, y = torch.randn(2, FEATURES, device=ctx.device), torch.randn(2, 1, device=ctx.device)
    try:
        with ddp.no_sync():
            F.mse_loss(ddp(x), y).backward()
    except RuntimeError as e:
        return str(e).strip().splitlines()[0]
    return None


class _Probe(MLP):
    def forward(self, x):  # its own code object: the graphs compiled for it are this job's alone
        return self.head(torch.tanh(self.fc(x)))


def compiled_graphs(ctx, sequential: bool) -> int:
    """How many graphs torch.compile(DDP(model)) hands its backend in one forward+backward: the model an
    nn.Sequential (torch.nn's own forward) or a module class with its own forward."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1)) if sequential else _Probe()
    ddp = DDP(model.to(ctx.device))
    x, y = torch.randn(2, FEATURES, device=ctx.device), torch.randn(2, 1, device=ctx.device)
    F.mse_loss(torch.compile(ddp, backend=backend)(x), y).backward()
    return len(graphs)
