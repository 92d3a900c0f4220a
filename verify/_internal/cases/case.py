"""One drawn case, the batches it implies, and the harness's loop that drives a trainer over them.

The harness, not the trainer, owns the data: it draws each optimizer step's global batch once
(N·B·W rows, from the adapter's `data`), splits it into N micro-batches and W rank shards, and hands
every call its own copy. After each call it checks that the trainer did not write into what it was
given: a trainer that edits its batch in place could change what the reference sees.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from verify._internal.protocol import Precision
from verify._internal.verdict import Gate, GateFailure

__all__ = ["Case", "Trace", "split", "shard", "drive", "twin"]


@dataclass(frozen=True, kw_only=True)
class Case:
    """One drawn combination. micro_batch is B per rank per micro-step; world W ranks."""

    accum_steps: int
    micro_batch: int
    steps: int
    world: int = 1
    seed: int = 0
    """Model init seed (Spec.seed)."""
    data_seed: int = 0
    device: str = "cpu"
    options: Any = None
    """The adapter's drawn knobs (model size, optimizer settings, ...), passed on as Spec.options."""
    precision: Precision = Precision.FP32
    """Autocast precision of the candidate runs (the float64 references never autocast); a string is taken."""
    lengths: tuple | None = None
    """Padded data (adapters with an ignore_index): valid targets per row, K·E entries in row order; the
    rest of each row's targets become the ignore_index (right padding)."""
    mesh: Any = None
    """A verify.Mesh for the mesh gate (adapters with mesh_axes): world is then its dp (rows are sharded over
    dp replicas only) and the ranks are mesh.size. None: plain data parallel over `world` ranks."""
    pipeline_chunks: int = 1
    """Micro-batches per pipeline schedule.step (Spec.pipeline_chunks); divides accum_steps."""
    terms: tuple | None = None
    """The objective's terms every run of the case computes (Spec.terms); None: all of them."""
    rank_rows: tuple | None = None
    """Uneven windows (adapters that declare `uneven`): per rank, the rows of each of its micro-steps, e.g.
    ((2, 2, 2), (3, 1)): rank 1 holds 4 rows in N_1 = 2 micro-steps. accum_steps and micro_batch then follow
    from it (the longest rank's N_r, the largest micro-batch). None: even, N micro-steps of B rows per rank."""
    last_window: int | None = None
    """A short last window (adapters that declare short_last_window; one process): the last of the K windows holds
    this many micro-batches of B rows, 1..N−1 (an epoch N does not divide). None: every window holds N."""

    def __post_init__(self):
        object.__setattr__(self, "precision", Precision(self.precision))
        if self.rank_rows is not None:
            rows = tuple(tuple(int(b) for b in r) for r in self.rank_rows)
            if len(rows) != self.world or self.mesh is not None or not all(rows) or min(map(min, rows)) < 1:
                raise ValueError(f"Case.rank_rows must hold, for each of the world's {self.world} ranks, at least one "
                                 f"micro-step of ≥ 1 row (no mesh), got {self.rank_rows}")
            object.__setattr__(self, "rank_rows", rows)
            object.__setattr__(self, "accum_steps", max(map(len, rows)))
            object.__setattr__(self, "micro_batch", max(map(max, rows)))
        if self.mesh is not None and self.mesh.dp != self.world:
            raise ValueError(f"Case.world must be the mesh's dp ({self.mesh}), got {self.world}")
        if self.last_window is not None and not (1 <= self.last_window < self.accum_steps and self.world == 1
                                                  and self.mesh is None and self.rank_rows is None):
            raise ValueError(f"Case.last_window must be 1..{self.accum_steps - 1} (fewer than accum_steps), in one "
                             f"process (world 1, no mesh, even windows); got {self.last_window} at world {self.world}")
        if self.accum_steps % self.pipeline_chunks:
            raise ValueError(f"Case.pipeline_chunks={self.pipeline_chunks} must divide accum_steps={self.accum_steps}")

    @property
    def ranks(self) -> int:
        """Processes the case runs on: mesh.size, or world."""
        return self.world if self.mesh is None else self.mesh.size

    @property
    def effective_batch(self) -> int:
        """Rows per optimizer step over all ranks: N·B·W (the one meaning of "effective batch"); uneven: Σ rank_rows."""
        if self.rank_rows is not None:
            return sum(map(sum, self.rank_rows))
        return self.accum_steps * self.micro_batch * self.world

    @property
    def uneven(self) -> bool:
        return self.rank_rows is not None

    def micro_steps(self, rank: int) -> int:
        """N_r: the micro-steps rank `rank` runs per optimizer step (accum_steps on an even window)."""
        return self.accum_steps if self.rank_rows is None else len(self.rank_rows[rank])

    @property
    def micro_blocks(self) -> int:
        """The blocks step 0's gradient sums over: Σ_r N_r (N·W on an even window; a short window 0 of K = 1: n)."""
        return self.window_of(0) if self.last_window is not None else sum(map(self.micro_steps, range(self.world)))

    def layout(self, k: int = 0) -> list[tuple[int, int, int]]:
        """(micro-step m, rank r, rows) of window k in the global batch's row order: micro-step by micro-step, rank
        by rank (a rank whose window has ended takes no rows) — on an even window, shard's order."""
        rows = self.rank_rows or ((self.micro_batch,) * self.window_of(k),) * self.world
        return [(m, r, rows[r][m]) for m in range(max(map(len, rows))) for r in range(self.world) if m < len(rows[r])]

    def window_of(self, k: int) -> int:
        """Micro-steps of window k in one process: N, or last_window for the run's last window where it is short."""
        return self.last_window if self.last_window is not None and k == self.steps - 1 else self.accum_steps

    def rows_of(self, k: int) -> int:
        """Rows of step k's global batch: effective_batch, fewer in a short last window."""
        return self.effective_batch if self.window_of(k) == self.accum_steps else self.last_window * self.micro_batch

    def spec(self, *, accum_steps: int | None = None, dtype=torch.float32, device: str | None = None, adapter=None,
             group=None, rank: int = 0):
        """The Spec of one run of this case. Given the adapter, a `scheduler_per_rank` declaration makes
        schedule_world this case's world, in the W-rank run and in every one-process reference of it alike.
        The case's mesh and pipeline_chunks apply to its own run only: a run given its own accum_steps (a
        reference, a block) is one process, Mesh() and one chunk. `group`: the rank's RankContext.group.
        Uneven windows: `rank`'s own N_r micro-steps. Given an adapter that declares `short_last_window`, Spec.windows."""
        from verify._internal.protocol import Spec

        per_rank = adapter is not None and getattr(adapter, "scheduler_per_rank", False)
        n = self.micro_steps(rank) if accum_steps is None else accum_steps
        short = adapter is not None and getattr(adapter, "short_last_window", False)
        windows = tuple(  # each window's micro-batches at this run's N (the big batch, N = 1: one each)
            self.window_of(k) if n == self.accum_steps else n for k in range(self.steps)) if short else None
        return Spec(accum_steps=n, dtype=dtype, windows=windows,
                    device=device or self.device, seed=self.seed, options=self.options,
                    precision="fp32" if dtype == torch.float64 else self.precision,
                    schedule_world=self.world if per_rank else 1, group=group, terms=self.terms,
                    **({} if accum_steps is not None or self.mesh is None else
                       dict(mesh=self.mesh, pipeline_chunks=self.pipeline_chunks)))

    def replace(self, **changes) -> "Case":
        return dataclasses.replace(self, **changes)

    def batches(self, adapter) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K global batches of N·B·W rows each, on the CPU, one data seed per optimizer step (right-padded
        with the adapter's ignore_index where the case has lengths); a short last window's holds fewer."""
        start, out = 0, []
        for k in range(self.steps):
            E = self.rows_of(k)
            x, y = adapter.batch(E, (self.data_seed << 16) + k, self.options)
            if self.lengths is not None:
                if adapter.ignore_index is None:
                    raise ValueError(f"{adapter.name} declares no ignore_index: a padded case does not apply")
                y = y.clone()
                for row, n in enumerate(self.lengths[start:start + E]):
                    y[row, n:] = adapter.ignore_index
            out.append((x, y))
            start += E
        return out

    def empty_steps(self) -> set[int]:
        """Steps whose global batch holds no valid target: a token-weighted trainer skips their update."""
        if self.lengths is None:
            return set()
        starts = [sum(map(self.rows_of, range(k))) for k in range(self.steps + 1)]
        return {k for k in range(self.steps) if sum(self.lengths[starts[k]:starts[k + 1]]) == 0}

    def as_dict(self) -> dict:
        opts = self.options
        if dataclasses.is_dataclass(opts):
            opts = {f.name: _plain(getattr(opts, f.name)) for f in dataclasses.fields(opts)}
        return dict(accum_steps=self.accum_steps, micro_batch=self.micro_batch, steps=self.steps, world=self.world,
                    effective_batch=self.effective_batch, seed=self.seed, data_seed=self.data_seed,
                    device=self.device, precision=self.precision,
                    lengths=None if self.lengths is None else list(self.lengths), options=_plain(opts),
                    **({} if self.terms is None else dict(terms=list(self.terms))),
                    **({} if self.rank_rows is None else dict(rank_rows=[list(r) for r in self.rank_rows])),
                    **({} if self.last_window is None else dict(last_window=self.last_window)),
                    **({} if self.mesh is None else dict(mesh=dataclasses.asdict(self.mesh),
                                                         pipeline_chunks=self.pipeline_chunks)))

    def __str__(self):
        w = f" W={self.world}" if self.world != 1 else ""
        p = f" {self.precision}" if self.precision != "fp32" else ""
        pad = "" if self.lengths is None else f" lengths={list(self.lengths)}"
        pad += "" if self.terms is None else f" terms={','.join(self.terms)}"
        if self.rank_rows is not None:  # B is then the largest micro-batch: the rows of each rank's micro-steps
            w += f" rank_rows={[list(r) for r in self.rank_rows]}"
        if self.last_window is not None:  # K windows, the last of them short
            w += f" last_window={self.last_window}"
        opts = "" if self.options is None else f" {_short(self.options)}"
        if self.mesh is not None:
            w = f" {self.mesh} chunks={self.pipeline_chunks}"
        return (f"N={self.accum_steps} B={self.micro_batch}{w} K={self.steps}{p} seed={self.seed} "
                f"data_seed={self.data_seed}{opts}{pad}")


def _plain(v):
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


def _short(opts) -> str:
    s = getattr(opts, "describe", None)
    return s() if callable(s) else repr(opts)


@dataclass
class Trace:
    """What one run returned: per-step losses, step-0 boundary grads, params after every step (CPU)."""

    losses: list[float]
    grads0: dict[str, torch.Tensor]
    params: list[dict[str, torch.Tensor]]
    seen: list[dict] = dataclasses.field(default_factory=list)
    """With an Observer (adapters that declare metrics): per step, what the trainer reported and what the
    harness saw of the same step (verify/_internal/metrics.py)."""
    first: dict | None = None
    """Where the first windows hold no valid target (their gradients all exactly 0): the first gradient with a
    nonzero element, the one whose unresolved elements the float64 parameter check leaves out (floor64.judged).
    None: grads0 is that gradient."""

    @property
    def resolving(self) -> dict:
        """The gradient the float64 checks resolve noise against: `first` where set, else grads0."""
        return self.first if self.first is not None else self.grads0


def split(inputs: torch.Tensor, targets: torch.Tensor, n: int):
    """(N·B, ...) -> N micro-batches of (B, ...), in order."""
    if inputs.shape[0] % n:
        raise ValueError(f"batch of {inputs.shape[0]} rows does not split into {n} equal micro-batches")
    return list(zip(inputs.chunk(n), targets.chunk(n)))


def shard(inputs: torch.Tensor, targets: torch.Tensor, accum_steps: int, rank: int, world: int, rank_rows=None):
    """One global step batch (N·W·B, ...) -> rank `rank`'s N micro-batches of (B, ...).

    Global micro-batch n is rows [n·W·B, (n+1)·W·B) (the single-process split into N) and rank r takes
    rows [r·B, (r+1)·B) of it: over ranks and micro-steps the union is the big batch, in order. `rank_rows`
    (Case.rank_rows, an uneven window): the same order (Case.layout), rank r taking rank_rows[r][m] rows at m."""
    if rank_rows is not None:
        out, start = [], 0
        for m in range(max(map(len, rank_rows))):
            for r, mine in enumerate(rank_rows):
                if m < len(mine):
                    if r == rank:
                        out.append((inputs[start:start + mine[m]], targets[start:start + mine[m]]))
                    start += mine[m]
        if start != inputs.shape[0]:
            raise ValueError(f"batch of {inputs.shape[0]} rows is not the {start} rows of rank_rows={rank_rows}")
        return out
    rows = inputs.shape[0]
    if rows % (accum_steps * world):
        raise ValueError(f"batch of {rows} rows does not split into {accum_steps} micro-steps × {world} ranks")
    b = rows // (accum_steps * world)
    return [(inputs[(n * world + rank) * b:(n * world + rank + 1) * b],
             targets[(n * world + rank) * b:(n * world + rank + 1) * b]) for n in range(accum_steps)]


# The twins, in the order they are run: each copy count an odd prime, so every division by a row or token count
# rounds differently from the reference's and from the other twins' (×2 is exact in binary: 6 copies round as 3).
TWIN_COPIES = (3, 5, 7)


def twin(batches, copies: int = TWIN_COPIES[0]):
    """The same global batches with their rows (whole sequences) in reverse order, `copies` times over:
    equal in exact arithmetic for a loss that is a mean over rows or valid tokens, so a reference run on
    them measures its own rounding. Reversal changes every sum's order; an odd count of copies changes every
    division by a row or token count, so a float32 loss shows in the gradients, not only in the loss (a batch
    of one row has no order to change)."""
    return [(x.flip(0).repeat(copies, *[1] * (x.dim() - 1)), y.flip(0).repeat(copies, *[1] * (y.dim() - 1)))
            for x, y in batches]


def _to(t: torch.Tensor, device, dtype) -> torch.Tensor:
    return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)


def _cpu(d: dict) -> dict:
    """CPU copies; a DTensor (tensor parallel) is gathered whole first, one at a time — a collective over its mesh, so
    this runs only in the windows the counter reports without judging (grads, params). Off a GPU the copies run in
    threads: a pageable copy's host half is ~1 GB/s in one (56 of one 1.1B equivalence case's 104 s on an H200)."""
    if len(d) > 1 and any(v.is_cuda for v in d.values()) and not any(hasattr(v, "full_tensor") for v in d.values()):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(8, len(d))) as pool:
            return dict(zip(d, pool.map(lambda v: v.detach().to("cpu", copy=True), d.values())))
    return {k: (v.full_tensor() if callable(getattr(v, "full_tensor", None)) else v).detach().to("cpu", copy=True)
            for k, v in d.items()}


class _NoMarks:
    marks = ()

    def mark(self, label) -> None:
        pass


def drive(trainer, batches, accum_steps: int, *, dtype=torch.float32, device="cpu", rank: int = 0,
          world: int = 1, windows=None, gate: Gate | None = None, observe=None, rank_rows=None, last=None,
          keep_params=True) -> Trace:
    """The harness's loop: shard each global batch, hand each micro-step its own copy, mark a window
    before every trainer call (for the collective counter), and return CPU copies of what came back.
    `gate`: the gate these runs serve, named by a failure (a trainer writing into its batch); None outside
    the gates ("harness"). `observe`: a verify._internal.metrics.Observer (the metrics gate's runs). `rank_rows`:
    an uneven window's (Case.rank_rows; accum_steps is then this rank's N_r). `last`: the micro-steps of the last
    window where it is short (Case.last_window, at the case's N; one process). `keep_params=False`: no CPU copy of
    the parameters after each step (Trace.params holds {} per step): a run read only for its losses or step-0
    gradient (κ's block runs), which at a billion float64 parameters would hold 8 GiB of host memory a step; a
    callable: called with (step, that step's CPU copy) instead of keeping it (a twin measured as it runs)."""
    from verify._internal.ranks.comm import set_active

    windows = windows or _NoMarks()
    set_active(windows)  # a Pull trainer re-marks micro-steps from its framework's thread
    try:
        return _drive(trainer, batches, accum_steps, dtype, device, rank, world, windows, gate, observe, rank_rows, last,
                      keep_params)
    finally:
        set_active(None)


def _drive(trainer, batches, accum_steps, dtype, device, rank, world, windows, gate, observe, rank_rows, last,
           keep_params) -> Trace:
    losses, params, kept = [], [], _FirstGrads(world == 1)
    stepping = observe.stepping if observe is not None else _not_observed
    for k, (inputs, targets) in enumerate(batches):
        given = []
        n = last if last is not None and k == len(batches) - 1 else accum_steps
        for m, (x, y) in enumerate(shard(inputs, targets, n, rank, world, rank_rows)):
            x, y = _to(x, device, dtype), _to(y, device, dtype)
            xc, yc = x.clone(), y.clone()  # the trainer's own copy; x, y stay the harness's
            given.append((m, x, y, xc, yc))
            windows.mark(("micro", k, m))
            if observe is not None:
                observe.micro(y)
            trainer.micro_step(xc, yc, m)
        at_step = getattr(trainer, "step_with_grads", None)  # Adapter(grads_from="optimizer"): verify/_internal/atstep.py
        if at_step is None:
            windows.mark(("grads", k))  # the harness reading the gradient: reported, not training traffic
            g = trainer.grads()
            if kept.wants():
                kept.keep(g)
            if observe is not None:
                observe.grads(g)
            windows.mark(("boundary", k))
            with stepping(trainer):
                loss = trainer.optimizer_step()
        else:
            windows.mark(("boundary", k))
            with stepping(trainer):
                g, loss = at_step()
            if kept.wants():
                windows.mark(("grads", k))  # gathering a DTensor is the harness reading, not training traffic
                kept.keep(g)
        loss = None if loss is None else float(loss)  # None: a rank that does not know it (a pipeline's first stage)
        windows.mark(("params", k))  # the harness reading: metrics() and params() are reported, not judged
        if observe is not None:
            observe.reported(trainer)
        if callable(keep_params):  # a streaming reader (floor64.TwinMeter): it reads this step's copy, none is kept
            keep_params(k, _cpu(trainer.params()))
        params.append(_cpu(trainer.params()) if keep_params is True else {})
        windows.mark(("after", k))
        losses.append(loss)
        for m, x, y, xc, yc in given:  # after the whole step: a trainer may keep its batch and edit it later
            for what, mine, theirs in (("inputs", x, xc), ("targets", y, yc)):
                if not torch.equal(mine, theirs):
                    raise GateFailure(
                        f"[{gate or 'harness'}] the trainer wrote into its {what} (step {k}, micro-step {m} of {accum_steps}"
                        f"{f', rank {rank}' if world > 1 else ''}): the batch it was handed changed in place. A "
                        f"trainer must not modify its batch (clone it first): in a real loop the same storage "
                        f"may be read again", gate=gate)
    return Trace(losses, kept.grads0 or {}, params, observe.steps if observe is not None else [], kept.first)


class _FirstGrads:
    """CPU copies of the step-0 gradient (Trace.grads0) and, in one process, where window 0 held no valid target
    (every element exactly 0), of the first gradient with a nonzero element (Trace.first). Several ranks keep grads0
    only: one rank's window may be empty where another's is not."""

    def __init__(self, one_process: bool):
        self.one_process, self.grads0, self.first, self.empty0 = one_process, None, None, False

    def wants(self) -> bool:
        return self.grads0 is None or (self.empty0 and self.first is None)

    def keep(self, g: dict) -> None:
        c = _cpu(g)
        zero = self.one_process and all(t is None or not bool(t.ne(0).any()) for t in c.values())
        if self.grads0 is None:
            self.grads0, self.empty0 = c, zero
        elif not zero:
            self.first = c


def _not_observed(trainer):
    return contextlib.nullcontext()
