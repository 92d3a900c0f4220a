"""hypothesis strategies for the gates; everything shrinks toward the smallest case (N=1, B=1, K=1, world 1).

    cases(adapter)                      (N, B, K, seeds, options, precision, padding), world 1
    dist_cases / mesh_cases             the same plus a world W (B per rank; uneven_windows where declared) / a mesh
    padding, uneven_windows, overflow_cases, mesh_split_cases

Every gate draws its known-hard corners first (cases/corners.py; with_corners: explicit @example's, never shrunk),
then the gate table's random_budget() random draws (gates/table.py); seed_only_draws makes a gate's draws a function of the seed alone.
An adapter's options come from its `options` hook (xtrain's: xtrain_proof/strategies.py).
Why: docs/design/protocol.md, "Drawing cases".
"""
from __future__ import annotations

import contextlib
import functools

from hypothesis import example
from hypothesis import strategies as st

from verify._internal.cases.case import Case
from verify._internal.objective import window_terms
from verify._internal.ranks.mesh import meshes

__all__ = ["cases", "dist_cases", "uneven_windows", "mesh_cases", "mesh_worlds", "overflow_cases", "mesh_split_cases", "padding",
           "with_corners", "seed_only_draws", "gate_device", "budget", "GATE_MIN_EXAMPLES"]

# Every gate of the plugin draws at least this many cases under any profile: the dev profile's fast loop
# must still exercise each gate on several drawn cases (one is a smoke test, and hypothesis shrinks it to
# the simplest case, e.g. an unpadded window, where most bugs cannot show).
GATE_MIN_EXAMPLES = 3


MAX_ACCUM, MAX_MICRO = 8, 4  # the largest window a gate's case draws, N micro-steps of B rows
# under the scale profile (verify.gpu_gate --scale): what a billion-parameter trainer's runs can hold (scaleplan)
SCALE_ACCUM, SCALE_MICRO, SCALE_STEPS = 4, 2, 2


def scale_profile() -> bool:
    from verify._internal.settings import current

    return current().hypothesis_profile == "scale"


def budget(share: int, least: int, n: int | None = None) -> int:
    """Examples for a test worth 1/share of the profile's budget (ci: 100), at least `least` — a floor that
    scales down with a profile under 100 (dev: 10 -> a tenth, never below 1), so the dev profile is fast."""
    from hypothesis import settings

    n = settings.default.max_examples if n is None else n  # n: another profile's max_examples
    floor = least if n >= 100 else max(1, round(least * n / 100))
    return max(floor, n // share)


def gate_device(settings=None) -> str:
    """--verify-device / XTRAIN_TEST_DEVICE of `settings` (default this process's, settings.current()): cuda runs
    the gates on the GPU; default cpu. Every strategy takes `device=` to draw another."""
    from verify._internal.settings import current

    return (settings or current()).device


def _options_strategy(adapter):
    opts = adapter.options
    if opts is None:
        opts = st.none() if adapter.defaults is None else st.just(adapter.defaults)
    elif not isinstance(opts, st.SearchStrategy):
        opts = opts()  # a zero-argument callable (keeps hypothesis out of the adapter's import)
    if adapter.grads_from == "optimizer" and adapter.unclipped is not None:  # read after clipping: unclipped too,
        return st.one_of(opts, opts.map(adapter.unclipped))  # so every gate also sees the pre-clip gradient (atstep.py)
    return opts


@st.composite
def uneven_windows(draw, *, world: int, max_accum: int, max_micro_batch: int) -> tuple | None:
    """Case.rank_rows: per rank, N_r in 1..max_accum micro-steps of 1..max_micro_batch rows each, never the same
    window on every rank (the last rank then holds one micro-step more, or one row more, or one fewer); shrinks
    toward one row on every rank but the last, which holds two micro-steps of one. None where the bounds allow
    no uneven window (one micro-step of one row)."""
    rows = [tuple(draw(st.lists(st.integers(1, max_micro_batch), min_size=1, max_size=max_accum), label=f"rank {r}"))
            for r in range(world)]
    if len(set(rows)) == 1:
        last = rows[-1]
        if len(last) < max_accum:
            rows[-1] = last + (1,)
        elif max(last) < max_micro_batch:
            rows[-1] = last[:-1] + (last[-1] + 1,)
        elif len(last) > 1:
            rows[-1] = last[:-1]
        else:
            return None
    return tuple(rows)


@st.composite
def padding(draw, *, steps: int, accum_steps: int, micro_batch: int, world: int, seq_len: int,
            empty_windows: bool = True, some_padding: bool = False, rank_rows=None, last_window=None) -> tuple:
    """Valid targets per row for K steps of N global micro-batches of W·B rows (row order as the harness
    draws them). Each global micro-batch is full, empty, random, or random with one rank's rows empty;
    shrinks toward full rows (no padding), so a failure is shown with the least padding that causes it.
    empty_windows=False (Adapter.empty_windows): no step's window is left without a valid target (its
    first row then keeps one). some_padding=True: the first global micro-batch is never full (shrinking
    toward one target fewer in each of its rows), so a window's micro-batches hold different numbers of
    valid targets — where a per-micro-batch or per-rank mean and the token mean part ways. `rank_rows`: an
    uneven window's rows (Case.rank_rows; a rank past its last micro-step holds no rows of that micro-batch).
    `last_window`: the last window's micro-batches where it is short (Case.last_window)."""
    out = []
    for i in range(steps * accum_steps - (0 if last_window is None else accum_steps - last_window)):
        m = i % accum_steps
        forced = some_padding and i == 0
        mode = draw(st.sampled_from(["random", "empty", "rank_empty"] if forced else ["full", "random", "empty", "rank_empty"]))
        empty_rank = draw(st.integers(0, world - 1)) if mode == "rank_empty" else -1
        for r in range(world):
            for _ in range(micro_batch if rank_rows is None else rank_rows[r][m] if m < len(rank_rows[r]) else 0):
                if mode == "full":
                    out.append(seq_len)
                elif mode == "empty" or r == empty_rank:
                    out.append(0)
                else:
                    out.append(draw(st.integers(1 if forced else 0, seq_len).map(lambda n: seq_len - n)))
    E = accum_steps * micro_batch * world if rank_rows is None else sum(map(sum, rank_rows))
    if not empty_windows:
        for k in range(steps):
            if not any(out[k * E:(k + 1) * E]):
                out[k * E] = 1
    return tuple(out)


def _row_length(adapter, options) -> int:
    return int(adapter.batch(1, 0, options)[1].reshape(1, -1).shape[1])


@st.composite
def cases(draw, adapter, *, min_accum: int = 1, max_accum: int = MAX_ACCUM, max_micro_batch: int = MAX_MICRO,
          min_steps: int = 1, max_steps: int = 3, device: str | None = None, world: int = 1,
          padded: bool | None = None, some_padding: bool = False, uneven: bool | None = None,
          short: bool = False) -> Case:
    """(N, B, K, seeds, options, precision[, padding][, uneven windows]) for `adapter`. N shrinks to min_accum,
    the rest to their minimum, the precision to the adapter's first. padded: None draws it (adapters with an
    ignore_index only), True / False forces it; some_padding: a padded window is never all full rows
    (padding(some_padding=True)); uneven: None draws it at W ≥ 2 for an adapter that declares `uneven` (shrinking
    toward even), False never; short: True draws, for an adapter that declares `short_last_window` (world 1, N ≥ 2),
    whether the last window is short and its 1..N−1 micro-batches (shrinking toward full windows)."""
    if scale_profile():
        max_accum, max_micro_batch = min(max_accum, SCALE_ACCUM), min(max_micro_batch, SCALE_MICRO)
        min_accum, max_steps = min(min_accum, max_accum), max(min_steps, min(max_steps, SCALE_STEPS))
    c = Case(
        accum_steps=draw(st.integers(min_accum, max_accum)),
        micro_batch=draw(st.integers(1, max_micro_batch)),
        steps=draw(st.integers(min_steps, max_steps)),
        world=world,
        options=draw(_options_strategy(adapter)),
        seed=draw(st.integers(0, 2**16)),
        data_seed=draw(st.integers(0, 2**16)),
        device=device or gate_device(),
        precision=draw(st.sampled_from(adapter.precisions)),
        terms=window_terms(adapter),
    )
    if world >= 2 and declares_uneven(adapter) and (uneven if uneven is not None else draw(st.booleans())):
        c = c.replace(rank_rows=draw(uneven_windows(world=world, max_accum=max_accum, max_micro_batch=max_micro_batch)))
    if short and world == 1 and c.accum_steps >= 2 and declares_short(adapter) and draw(st.booleans()):
        c = c.replace(last_window=draw(st.integers(1, c.accum_steps - 1).map(lambda n: c.accum_steps - n)))
    if adapter.ignore_index is not None and (padded if padded is not None else draw(st.booleans())):
        c = c.replace(lengths=draw(padding(steps=c.steps, accum_steps=c.accum_steps, micro_batch=c.micro_batch,
                                           world=world, seq_len=_row_length(adapter, c.options),
                                           empty_windows=adapter.empty_windows, some_padding=some_padding,
                                           rank_rows=c.rank_rows, last_window=c.last_window)))
    return c


def declares_short(adapter) -> bool:
    """Short last windows are drawn only for an adapter that declares them (Adapter.short_last_window): a trainer
    told nothing divides every window by N, right only on full ones."""
    return bool(getattr(adapter, "short_last_window", False))


def declares_uneven(adapter) -> bool:
    """Uneven windows are drawn only for an adapter that declares them (Adapter.uneven, with data_parallel): an
    equal-weight average over ranks (DDP's) is right on even windows, wrong on uneven ones."""
    return bool(getattr(adapter, "uneven", False) and adapter.data_parallel)


@st.composite
def dist_cases(draw, adapter, *, min_world: int = 1, max_world: int = 4, **bounds) -> Case:
    """`cases(adapter, **bounds)` at a world size W (shrinks toward min_world: a failure is reported at
    the smallest world that shows it); micro_batch is then B per rank."""
    return draw(cases(adapter, world=draw(st.integers(min_world, max_world)), **bounds))


def mesh_worlds(adapter, min_world: int, max_world: int) -> list:
    """The worlds min_world..max_world (min_world capped by max_world) that have a mesh over the adapter's axes
    within its mesh_sizes, smallest first."""
    lo = min(min_world, max_world)
    return [w for w in range(lo, max_world + 1) if meshes(adapter.mesh_axes, w, adapter.mesh_sizes)]


@st.composite
def mesh_cases(draw, adapter, *, min_world: int = 2, max_world: int = 4, max_chunks: int = 4, max_outer: int = 3,
               max_micro_batch: int = 4, max_steps: int = 3, device: str | None = None) -> Case:
    """A mesh of min_world..max_world ranks over the adapter's mesh_axes (dp only beside another axis), its
    pipeline_chunks (1..max_chunks where pp > 1) and outer steps, N = chunks × outer, and cases()' other
    draws (B per dp replica; padding drawn for an adapter with an ignore_index, right-padded rows whose padding
    lands on the last cp ranks: _mesh_padded). Only meshes within the adapter's mesh_sizes, and only worlds that
    have one (mesh_worlds). Shrinks toward the smallest world, the shallowest pipeline, one chunk, one outer step,
    no padding."""
    worlds = mesh_worlds(adapter, min_world, max_world)
    if not worlds:  # the gate skips first, saying so (verify/test_gates_mesh.py)
        raise ValueError(f"{adapter.name}: no mesh of {min_world}..{max_world} ranks over {adapter.mesh_axes} "
                         f"within mesh_sizes={adapter.mesh_sizes}")
    world = draw(st.sampled_from(worlds))
    mesh = draw(st.sampled_from(meshes(adapter.mesh_axes, world, adapter.mesh_sizes)))
    chunks = draw(st.integers(1, max_chunks)) if mesh.pp > 1 else 1
    outer = draw(st.integers(1, max_outer))
    c = draw(cases(adapter, min_accum=1, max_accum=1, max_micro_batch=max_micro_batch, max_steps=max_steps,
                   device=device, world=mesh.dp, padded=False, uneven=False))
    return draw(_mesh_padded(adapter, c.replace(accum_steps=chunks * outer, mesh=mesh, pipeline_chunks=chunks)))


@st.composite
def _mesh_padded(draw, adapter, case: Case) -> Case:
    """`case` (its N, B, K and dp final), padded or not (drawn) where the adapter has an ignore_index: random
    right padding per row (so a cp rank may hold only padding of a row, or of a window), micro-batches empty on
    one dp replica or on all (padding()); shrinks toward no padding."""
    if adapter.ignore_index is None or not draw(st.booleans(), label="padded"):
        return case
    return case.replace(lengths=draw(padding(steps=case.steps, accum_steps=case.accum_steps, world=case.world,
                                             micro_batch=case.micro_batch, seq_len=_row_length(adapter, case.options),
                                             empty_windows=adapter.empty_windows)))


@st.composite
def overflow_cases(draw, adapter, *, min_world: int = 1, max_world: int = 1, **bounds) -> tuple:
    """(case, micro-step, rank) for the injected-overflow gate: an fp16 case of K = 2 windows at a world in
    [min_world, max_world], the micro-step and the rank whose micro-batch overflows in window 0."""
    case = draw(dist_cases(adapter, min_world=min_world, max_world=max_world, max_accum=4, min_steps=2, max_steps=2,
                           uneven=False, **bounds), label="case").replace(precision="fp16")
    micro = draw(st.integers(0, case.accum_steps - 1), label="overflowing micro-step")
    return case, micro, draw(st.integers(0, case.world - 1), label="overflowing rank")


@st.composite
def mesh_split_cases(draw, adapter, *, min_world: int = 2, max_world: int = 4) -> tuple:
    """(case, world) for the mesh split gate: one window of N = chunks × outer micro-steps of B·world rows
    (every dp of the world divides them), to run on every mesh of `world` ranks over the adapter's axes."""
    world = draw(st.sampled_from(mesh_worlds(adapter, min_world, max_world)), label="world")
    chunks = draw(st.integers(1, 4), label="pipeline chunks") if "pp" in adapter.mesh_axes else 1
    c = draw(cases(adapter, min_accum=1, max_accum=1, max_micro_batch=2, max_steps=2, padded=False), label="case")
    outer = draw(st.integers(1, 2), label="outer steps")
    c = c.replace(accum_steps=chunks * outer, micro_batch=c.micro_batch * world, pipeline_chunks=chunks)
    return draw(_mesh_padded(adapter, c), label="padded case"), world


@contextlib.contextmanager
def seed_only_draws():
    """Within it, hypothesis draws from the seed and the strategies alone. hypothesis (6.170 here) also picks, in ~5% of its
    integer, float and string draws, one of the constants of the LOCAL modules (not stdlib or site-packages)
    the process has imported so far (hypothesis.internal.conjecture.providers._get_local_constants; no setting
    turns it off). That pool differs between processes (the controller of `python -m verify.run` has imported
    verify.run, verify._internal.ranks.launched and verify._internal.header's 0o644 by its first draw; a pytest run of the same gate
    has not) and grows as a run imports more: with one --hypothesis-seed a launched world and a pooled run drew
    different cases, and a printed seed need not replay its cases elsewhere. Here the pool is empty (hypothesis'
    own constants stay); a hypothesis without the hook is left as it is."""
    try:
        from hypothesis.internal.conjecture import providers

        real, cache, empty = providers._get_local_constants, providers.CONSTANTS_CACHE.cache, providers.Constants()
    except (ImportError, AttributeError):
        yield
        return
    providers._get_local_constants = lambda: empty
    cache.clear()  # allowed constants per (type, bounds), cached from the pool: none may outlive a switch
    try:
        yield
    finally:
        providers._get_local_constants = real
        cache.clear()


def with_corners(test, values, arg: str = "case"):
    """`test` (a @given function) with each corner as an explicit example of its argument `arg`, drawing from
    the seed alone (seed_only_draws)."""
    for v in reversed(values):  # hypothesis runs explicit examples in decorator order: keep corners' order
        test = example(**{arg: v})(test)

    @functools.wraps(test)
    def seeded(*args, **kwargs):
        with seed_only_draws():
            return test(*args, **kwargs)

    return seeded

