"""The known-hard cases every gate draws first, in every profile (explicit examples, run before the random draws,
never shrunk): `corners(adapter, gate)`, with the table of what each gate's corners hold in its docstring.

The padded corners of the mesh gates, for token-weighted trainers (an ignore_index), are where a per-rank count
shows. A right-padded row's padding sits at its end, and cp rank c holds tokens [c·S/cp, (c+1)·S/cp) of it
(cp_slice): the LAST cp rank gets the padding, so its valid count differs from the others' on every padded row —
the field's common case. A trainer whose cp ranks each divide by their own count is exact on unpadded rows and
wrong there; one whose dp replicas each take their own mean, likewise wrong where one replica's micro-batch is empty.

Why corners: docs/design/protocol.md, "Drawing cases"; the padded meshes: docs/design/distributed.md, "Padded meshes".
"""
from __future__ import annotations

from verify._internal.cases.case import Case
from verify._internal.cases.strategies import (_options_strategy, _row_length, declares_short, declares_uneven,
                                                gate_device, seed_only_draws)
from verify._internal.objective import window_terms
from verify._internal.ranks.mesh import meshes
from verify._internal.verdict import Gate

__all__ = ["corners", "LONG_CORNER", "LONG_N", "mesh_padding", "corner_axes"]


def corner_axes(adapter) -> list[str]:
    """The axes the mesh gate's corners put two ranks on: pp, tp, cp where declared; dp too for a token-weighted
    adapter (its padded corner empties one replica's micro-batch: a per-replica mean shows only there)."""
    padded = adapter.ignore_index is not None
    return [a for a in ("pp", "tp", "cp", "dp") if a in adapter.mesh_axes and (a != "dp" or padded)]


def mesh_padding(*, steps: int, accum_steps: int, micro_batch: int, dp: int, seq_len: int, cp: int) -> tuple:
    """Valid targets per row, in the harness's row order (step, micro-step, dp replica, row), right-padded:

        window 0, micro-batch 0   each replica's first row one token short (the last cp rank holds a padded part of
                                  it), its other rows within the first cp ranks' tokens (the last holds only padding)
        window 0, micro-batch 1   empty on the last dp replica (at dp = 1: an empty micro-batch); short elsewhere
        window 0, later ones      full rows
        window 1 and later        every row within the first cp ranks' tokens: the last cp rank holds only padding in
                                  the whole window (its own count is 0), no window without a valid target

    cp = 1 (a dp, pp or tp corner): the same shape with the rows' second half as the "last cp rank"."""
    cut = seq_len - seq_len // cp if cp > 1 else max(1, seq_len // 2)  # tokens before the last cp rank's share
    short = max(1, cut - 1)
    out = []
    for k in range(steps):
        for m in range(accum_steps):
            for r in range(dp):
                for b in range(micro_batch):
                    if k > 0:
                        out.append(cut if b % 2 == 0 else 1)
                    elif m == 0:
                        out.append(seq_len - 1 if b == 0 else short)
                    elif m == 1:
                        out.append(0 if r == dp - 1 else short)
                    else:
                        out.append(seq_len)
    return tuple(out)


def _corner_options(adapter):
    """The adapter's declared defaults, else the simplest value of its options strategy (what shrinking reaches)."""
    if adapter.defaults is not None or adapter.options is None:
        return adapter.defaults
    from hypothesis import HealthCheck, Phase, find, settings

    quiet = settings(database=None, max_examples=10, phases=(Phase.generate, Phase.shrink),
                     suppress_health_check=list(HealthCheck))
    with seed_only_draws():
        return find(_options_strategy(adapter), lambda _: True, settings=quiet)


def _hard_padding(case: Case, seq_len: int) -> tuple:
    """Window 0: micro-batch 0 partly padded (its rows' valid counts differ), micro-batch 1 empty, micro-batch 2
    (N ≥ 3) empty on the last rank only; later windows full but one row. No window is left without a valid target."""
    W, out = case.world, []
    for k in range(case.steps):
        for m, r, rows in case.layout(k):
            for b in range(rows):
                if k == 0 and m == 0:
                    out.append(max(1, seq_len // 2) if (r, b) == (0, 0) else seq_len - 1)
                elif k == 0 and (m == 1 or (m == 2 and r == W - 1)):
                    out.append(0)
                else:
                    out.append(seq_len - 1 if (m, r, b) == (0, 0, 0) else seq_len)
    assert len(out) == sum(map(case.rows_of, range(case.steps)))
    return tuple(out)


def _base(adapter, *, N: int, B: int, K: int, W: int = 1, padded: bool = False, device: str | None = None,
          rank_rows=None, last_window=None) -> Case:
    c = Case(accum_steps=N, micro_batch=B, steps=K, world=W, seed=1, data_seed=2, options=_corner_options(adapter),
             device=device or gate_device(), precision=adapter.precisions[0], terms=window_terms(adapter),
             rank_rows=rank_rows, last_window=last_window)
    if padded and adapter.ignore_index is not None:
        c = c.replace(lengths=_hard_padding(c, _row_length(adapter, c.options)))
    return c


def _mesh_corner(adapter, axis: str, B: int = 2, split: bool = False):
    """Two ranks on `axis` (pp=2: every pipeline adapter's smallest; tp=2; cp=2; dp=2), two outer steps — with pp,
    two chunks per schedule step: where a schedule's own 1/chunks compounds over the outer steps (scale_grads=True).
    With an ignore_index, padded (mesh_padding: the last cp rank's tokens padding, one replica's
    micro-batch empty); `split`: laid out for a split over 2 ranks (B rows = 2 replicas' halves)."""
    mesh = next((m for m in meshes(adapter.mesh_axes, 2, adapter.mesh_sizes) if getattr(m, axis) == 2), None)
    if mesh is None:
        return None
    chunks = 2 if axis == "pp" else 1
    c = _base(adapter, N=1, B=B, K=2, W=mesh.dp).replace(accum_steps=chunks * 2, mesh=mesh, pipeline_chunks=chunks)
    if adapter.ignore_index is None:
        return c
    dp, cp = (2, 2 if "cp" in adapter.mesh_axes else 1) if split else (mesh.dp, mesh.cp)
    return c.replace(lengths=mesh_padding(steps=c.steps, accum_steps=c.accum_steps, micro_batch=B * mesh.dp // dp,
                                          dp=dp, seq_len=_row_length(adapter, c.options), cp=cp))


# The long-window corner: K = 2 windows of N = 129 micro-steps, 258 in the run: past 256, where a uint8 counter
# wraps (window 0 alone passes 128, an int8's), and N divides neither, so a wrapped count lands mid-window.
LONG_CORNER = (129, 2)
LONG_N = 256  # the longest window the long-window gate draws; every declared low precision runs at it


def corners(adapter, gate: Gate, *, min_world: int = 1, max_world: int = 1) -> list:
    """The known-hard cases of the gate test of `gate` (gate_corners), then, for each size threshold the adapter
    declares (Adapter.thresholds), the first of them on both sides of it: a path the stack takes only past a size
    (a second DDP bucket, a second loss chunk) is run by every gate, as is the path below it."""
    out = gate_corners(adapter, gate, min_world=min_world, max_world=max_world)
    return out + [_crossed(out[0], t, above) for t in adapter.thresholds for above in (False, True)] if out else out


def _crossed(corner, threshold, above: bool):
    """A corner (a Case, or a tuple of one and the check's further arguments, Cases among them: the long window's)
    with the options of each of its Cases on one side of `threshold`."""
    if isinstance(corner, tuple):
        return tuple(_crossed(c, threshold, above) if isinstance(c, Case) else c for c in corner)
    return corner.replace(options=threshold.apply(corner.options, above))


def gate_corners(adapter, gate: Gate, *, min_world: int = 1, max_world: int = 1) -> list:
    """The known-hard cases of the gate test of `gate` (a gate with a budget in gates/table.py) for `adapter`,
    within [min_world, max_world], in the form its @given draws (a Case; overflow: (case, micro, rank); mesh split
    invariance: (case, world)):

    equivalence, normaliser, empty window,   N=3 B=2 K=2, padded (ignore_index): an empty micro-batch in
    path parity                             window 0; equivalence, for an adapter that declares short_last_window:
                                            also the same with window 1 short (last_window=2)
    split invariance                        the same window, N=3 K=1, micro-batch 0 partly padded
    reported metrics                        N=3 B=2 K=3, padded: as equivalence's, one step longer; again in
                                            each declared bf16 / fp16 (its reports judged in that precision too)
    data-parallel equivalence               N ≥ 2 at W = 2 (and at the top world), padded: an empty micro-batch
    (and boundary-only), bytes per step     and one empty on the last rank only; data-parallel, for an adapter
                                            that declares `uneven`: also rank_rows (2, 2, 2) on every rank but the
                                            last, (3, 1) on it (fewer micro-steps, fewer rows), padded
    overflow                                the overflow in the boundary's micro-step (N−1) on the LAST rank of
                                            the top world; at W ≥ 2 also micro-step 0 on rank 1 of W=2
    mesh equivalence, mesh split invariance pp=2 with 2 chunks × 2 outer steps; tp=2, cp=2 with 2 outer steps;
                                            with an ignore_index padded (mesh_padding), and dp=2 too (mesh)
    long window (and partial sums)          N=129 B=1 K=2 (LONG_CORNER): a run of more than 256 micro-steps; its
                                            low-precision window N=LONG_N K=1
    """
    lo, hi, gate = min_world, max(min_world, max_world), Gate(gate)
    if gate in (Gate.EQUIVALENCE, Gate.NORMALISER, Gate.EMPTY_WINDOW, Gate.PATH_PARITY):
        short = gate is Gate.EQUIVALENCE and declares_short(adapter)  # then also window 1 short: 2 of 3 micro-batches
        return [_base(adapter, N=3, B=2, K=2, padded=True)] + ([_base(adapter, N=3, B=2, K=2, padded=True,
                                                                      last_window=2)] if short else [])
    if gate is Gate.SPLIT_INVARIANCE:
        return [_base(adapter, N=3, B=2, K=1, padded=True)]
    if gate is Gate.LONG_WINDOW:  # (the window, its low-precision window: N = LONG_N, one step)
        c = _base(adapter, N=LONG_CORNER[0], B=1, K=LONG_CORNER[1])
        return [(c, c.replace(accum_steps=LONG_N, steps=1))]
    if gate is Gate.REPORTED_METRICS:  # three steps: a warm-up's LR changes between them; each declared autocast precision
        base = _base(adapter, N=3, B=2, K=3, padded=True)
        return [base] + [base.replace(precision=p) for p in adapter.precisions if p != base.precision and p != "fp32"]
    if gate in (Gate.DP_EQUIVALENCE, Gate.BYTES_PER_STEP):
        worlds = sorted({w for w in (max(2, lo), hi) if lo <= w <= hi and w >= 2})
        out = [_base(adapter, N=3, B=2, K=2, W=w, padded=True) for w in worlds]
        if gate is Gate.DP_EQUIVALENCE and worlds and declares_uneven(adapter):
            w = worlds[0]
            out.append(_base(adapter, N=3, B=2, K=2, W=w, padded=True, rank_rows=((2, 2, 2),) * (w - 1) + ((3, 1),)))
        return out
    if gate is Gate.OVERFLOW:
        top = _base(adapter, N=3, B=2, K=2, W=hi).replace(precision="fp16")
        out = [(top, 2, hi - 1)]
        if hi > 2 and lo <= 2:
            out.append((top.replace(world=2), 0, 1))
        return out
    if gate is Gate.MESH_EQUIVALENCE:
        return [c for c in (_mesh_corner(adapter, a) for a in corner_axes(adapter)) if c] if lo <= 2 <= hi else []
    if gate is Gate.MESH_SPLIT_INVARIANCE:
        axis = next((a for a in corner_axes(adapter) if a != "dp"), None)
        c = _mesh_corner(adapter, axis, B=2 * 2, split=True) if lo <= 2 <= hi and axis else None
        return [(c.replace(mesh=None, world=1), 2)] if c else []
    return []
