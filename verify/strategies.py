"""hypothesis strategies for the gates. Bounds are keyword-only; everything shrinks toward the smallest
case (N=1, B=1, K=1, world 1, the adapter's smallest options), so a failure is reported at its simplest.

    cases(adapter)                      (N, B, K, seeds, the adapter's drawn options, precision, and —
                                        for adapters with an ignore_index — padding), world 1
    dist_cases(adapter, max_world=4)    the same plus a world size W; B is then per rank
    mesh_cases(adapter, max_world=4)    a dp × pp × tp mesh over the adapter's mesh_axes (2..max_world ranks),
                                        N = pipeline_chunks × outer steps; B per dp replica
    padding(...)                        valid targets per row: empty rows, micro-batches and ranks included

An adapter's own options come from its `options` hook (a strategy, or a zero-argument callable giving one):
xtrain's are verify/adapters/xtrain_strategies.py.
"""
from __future__ import annotations


from hypothesis import strategies as st

from .case import Case
from .mesh import meshes

__all__ = ["cases", "dist_cases", "mesh_cases", "mesh_worlds", "padding", "gate_device", "budget", "gate_budget", "GATE_MIN_EXAMPLES", "GATE_BUDGETS"]

# Every gate of the plugin draws at least this many cases under any profile: the dev profile's fast loop
# must still exercise each gate on several drawn cases (one is a smoke test, and hypothesis shrinks it to
# the simplest case, e.g. an unpadded window, where most bugs cannot show).
GATE_MIN_EXAMPLES = 3


def budget(share: int, least: int, n: int | None = None) -> int:
    """Examples for a test worth 1/share of the profile's budget (ci: 100), at least `least` — a floor that
    scales down with a profile under 100 (dev: 10 -> a tenth, never below 1), so the dev profile is fast."""
    from hypothesis import settings

    n = settings.default.max_examples if n is None else n  # n: another profile's max_examples
    floor = least if n >= 100 else max(1, round(least * n / 100))
    return max(floor, n // share)


# Each gate test's share of the profile's budget and its floor (budget()): the one table behind the example
# counts the guide states (docs/verify-your-trainer.md §1; tests/harness/test_plugin.py checks them).
# token_mean / empty_window: ~6 trainers built per case (HF's Trainer: ~1 s each), and every count bug shows
# on nearly every padded case, so a fifth of split invariance's share.
GATE_BUDGETS = {"equivalence": (1, 1), "bit_exact": (1, 1), "split_invariance": (10, 3), "token_mean": (20, 3),
                "empty_window": (20, 3), "long_windows": (30, 2), "data_parallel": (2, 8), "bytes_per_step": (30, 3),
                "overflow": (10, 3), "mesh": (10, 3), "mesh_split": (30, 2)}


def gate_budget(gate: str, n: int | None = None) -> int:
    """Examples a gate test of the plugin draws under the loaded profile (or one of max_examples n):
    budget(*GATE_BUDGETS[gate]), never below GATE_MIN_EXAMPLES."""
    return max(GATE_MIN_EXAMPLES, budget(*GATE_BUDGETS[gate], n=n))


def gate_device() -> str:
    """--verify-device / XTRAIN_TEST_DEVICE: cuda runs the gates on the GPU; default cpu."""
    from .settings import Settings

    return Settings.from_env().device


def _options_strategy(adapter):
    opts = adapter.options
    if opts is None:
        return st.none() if adapter.defaults is None else st.just(adapter.defaults)
    if isinstance(opts, st.SearchStrategy):
        return opts
    return opts()  # a zero-argument callable (keeps hypothesis out of the adapter's import)


@st.composite
def padding(draw, *, steps: int, accum_steps: int, micro_batch: int, world: int, seq_len: int,
            empty_windows: bool = True, some_padding: bool = False) -> tuple:
    """Valid targets per row for K steps of N global micro-batches of W·B rows (row order as the harness
    draws them). Each global micro-batch is full, empty, random, or random with one rank's rows empty;
    shrinks toward full rows (no padding), so a failure is shown with the least padding that causes it.
    empty_windows=False (Adapter.empty_windows): no step's window is left without a valid target (its
    first row then keeps one). some_padding=True: the first global micro-batch is never full (shrinking
    toward one target fewer in each of its rows), so a window's micro-batches hold different numbers of
    valid targets — where a per-micro-batch or per-rank mean and the token mean part ways."""
    out = []
    for i in range(steps * accum_steps):
        forced = some_padding and i == 0
        mode = draw(st.sampled_from(["random", "empty", "rank_empty"] if forced else ["full", "random", "empty", "rank_empty"]))
        empty_rank = draw(st.integers(0, world - 1)) if mode == "rank_empty" else -1
        for r in range(world):
            for _ in range(micro_batch):
                if mode == "full":
                    out.append(seq_len)
                elif mode == "empty" or r == empty_rank:
                    out.append(0)
                else:
                    out.append(draw(st.integers(1 if forced else 0, seq_len).map(lambda n: seq_len - n)))
    E = accum_steps * micro_batch * world
    if not empty_windows:
        for k in range(steps):
            if not any(out[k * E:(k + 1) * E]):
                out[k * E] = 1
    return tuple(out)


def _row_length(adapter, options) -> int:
    return int(adapter.batch(1, 0, options)[1].reshape(1, -1).shape[1])


@st.composite
def cases(draw, adapter, *, min_accum: int = 1, max_accum: int = 8, max_micro_batch: int = 4,
          min_steps: int = 1, max_steps: int = 3, device: str | None = None, world: int = 1,
          padded: bool | None = None, some_padding: bool = False) -> Case:
    """(N, B, K, seeds, options, precision[, padding]) for `adapter`. N shrinks to min_accum, the rest to
    their minimum, the precision to the adapter's first. padded: None draws it (adapters with an
    ignore_index only), True / False forces it; some_padding: a padded window is never all full rows
    (padding(some_padding=True))."""
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
    )
    if adapter.ignore_index is not None and (padded if padded is not None else draw(st.booleans())):
        c = c.replace(lengths=draw(padding(steps=c.steps, accum_steps=c.accum_steps, micro_batch=c.micro_batch,
                                           world=world, seq_len=_row_length(adapter, c.options),
                                           empty_windows=adapter.empty_windows, some_padding=some_padding)))
    return c


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
    draws (B per dp replica; no padding: the mesh gate judges mean losses). Only meshes within the adapter's
    mesh_sizes, and only worlds that have one (mesh_worlds). Shrinks toward the smallest world, the
    shallowest pipeline, one chunk, one outer step."""
    worlds = mesh_worlds(adapter, min_world, max_world)
    if not worlds:  # the gate skips first, saying so (verify/test_gates_mesh.py)
        raise ValueError(f"{adapter.name}: no mesh of {min_world}..{max_world} ranks over {adapter.mesh_axes} "
                         f"within mesh_sizes={adapter.mesh_sizes}")
    world = draw(st.sampled_from(worlds))
    mesh = draw(st.sampled_from(meshes(adapter.mesh_axes, world, adapter.mesh_sizes)))
    chunks = draw(st.integers(1, max_chunks)) if mesh.pp > 1 else 1
    outer = draw(st.integers(1, max_outer))
    c = draw(cases(adapter, min_accum=1, max_accum=1, max_micro_batch=max_micro_batch, max_steps=max_steps,
                   device=device, world=mesh.dp, padded=False))
    return c.replace(accum_steps=chunks * outer, mesh=mesh, pipeline_chunks=chunks)
