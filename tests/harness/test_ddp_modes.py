"""torch DDP's options through the public protocol (planted/ddp_modes.py): each mode passes the
data-parallel gates against its own count table row, the planted bugs are rejected naming the row, and
what the installed torch does where upstream reports say DDP misbehaves (static_graph + no_sync, a
compiled DDP module + no_sync, find_unused + no_sync with an unused set that changes per micro-step)."""
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planted import ddp_modes, registry as planted
from planted.ddp_modes import MODES, P_MLP, P_ROUTER, Router
from verify._internal.cases.case import Case, shard
from verify._internal.gates import GateFailure, check_distributed
from verify._internal.gates.counts import families
from verify._internal.gates.worlds import max_world, min_world
from verify._internal.ranks.pool import DistJobError, get_pool
from verify._internal.cases.strategies import budget, dist_cases

pytestmark = pytest.mark.distributed

MAX_WORLD, MIN_WORLD = max_world(), min_world()
WORLDS = dict(min_world=max(2, MIN_WORLD), max_world=max(2, MIN_WORLD, min(MAX_WORLD, 3)))
needs_2 = pytest.mark.skipif(MAX_WORLD < 2, reason="needs world ≥ 2 (XTRAIN_DIST_MAX_WORLD / GPUs)")
TORCH = torch.__version__



# per mode: (hypothesis budget, case bounds). torch.compile costs ~4-10 s per rank pool on first use
# (the graphs are then cached in the pool's processes), so the compiled mode draws fewer, shorter cases.
BOUNDS = {"bucket_view": (budget(20, 3), {}), "static_graph": (budget(20, 3), {}),
          "find_unused": (budget(15, 4), dict(max_micro_batch=2)),
          "compiled": (budget(50, 2), dict(max_steps=2, max_accum=4))}


def _mode_test(mode):
    n, bounds = BOUNDS[mode]

    @needs_2
    @settings(max_examples=n, deadline=None)
    @given(data=st.data())
    def test(data):
        adapter = MODES[mode]
        case = data.draw(dist_cases(adapter, **WORLDS, max_accum=bounds.get("max_accum", 5),
                                    **{k: v for k, v in bounds.items() if k != "max_accum"}))
        r = check_distributed(adapter, case)  # the row is checked on every rank, step and micro-step
        P = P_ROUTER if mode == "find_unused" else P_MLP
        for (rank, dt), steps in r.extra["comm"].steps.items():
            assert [s.boundary_elements for s in steps] == [P + 1] * case.steps, (mode, rank, dt, case)

    test.__doc__ = f"DDP mode {mode!r} passes the data-parallel gates with its count table row (worlds 2-3)."
    return test


test_bucket_view = _mode_test("bucket_view")
test_static_graph = _mode_test("static_graph")
test_find_unused = _mode_test("find_unused")
test_compiled = pytest.mark.slow(_mode_test("compiled"))  # torch.compile's first use: ~10 s


def test_every_mode_declares_its_row():
    for mode, a in MODES.items():
        row = a.counts(Case(accum_steps=2, micro_batch=1, steps=1, world=2))
        assert row.mode == mode and a.process_group and a.data_parallel, mode
        assert row.before == {} and row.elements[0] == row.elements[1], row


@needs_2
@settings(max_examples=budget(10, 2), deadline=None)
@given(data=st.data())
def test_a_float64_reference_in_another_mode_is_judged_by_its_own_row(data):
    """Distributed.counts64: the float64 reference syncs every micro-step (a framework's float64 path in another
    mode), the float32 runs only at the boundary; each run is judged by its own row (undeclared: ROW_BUGS)."""
    adapter = ddp_modes.reference_syncs_every_micro
    case = data.draw(dist_cases(adapter, **WORLDS, min_accum=2, max_accum=4, max_steps=2))
    steps = check_distributed(adapter, case).extra["comm"].steps
    for (rank, dt), ss in steps.items():  # micro-steps 0..N-2: one bucket all-reduce each in float64, none in float32
        per_micro = {len([c for c in m if c.op == "all_reduce"]) for s in ss for m in s.micro}
        assert per_micro == ({1} if dt == "torch.float64" else {0}), (rank, dt, per_micro, case)
        assert [s.boundary_elements for s in ss] == [P_MLP + 1] * case.steps, (rank, dt, case)


# -- planted bugs ---------------------------------------------------------------------------------

ROW_BUGS = [b.name for b in planted.of_gate("boundary-only", module="ddp_modes")]  # each message names its row

@needs_2
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if "compiled" in n else n  # torch.compile: ~5 s
                                  for n in ROW_BUGS])
@settings(max_examples=budget(50, 2), deadline=None)
@given(data=st.data())
def test_rejects_broken(name, data):
    """no_sync around backward only (find_unused, compiled: every micro-step syncs) and find_unused
    checked against bucket_view's row (its int32 bitmap undeclared): rejected, naming the row."""
    adapter, pattern = planted.BY_NAME[name].adapter, planted.BY_NAME[name].pattern
    worlds = dict(min_world=WORLDS["min_world"], max_world=WORLDS["min_world"]) if "compiled" in name else WORLDS
    case = data.draw(dist_cases(adapter, **worlds, min_accum=2, max_accum=4, max_steps=2))  # compiled: one world
    with pytest.raises(GateFailure) as e:
        check_distributed(adapter, case)
    msg = str(e.value)
    assert re.search(pattern, msg), msg  # names the count table row
    if name.endswith("backward_only"):
        assert "micro-step 0 of" in msg and "before the boundary" in msg and "all_reduce float32" in msg, msg
    elif name == "reference_row_undeclared":  # the float32 runs meet bucket_view's row; the float64 run does not
        assert "all_reduce float64" in msg, msg
    elif name == "bucket_view_ignores_head_bias":  # the counts match: the element bound alone rejects it
        assert f"the reductions carry {P_MLP} floating elements" in msg and f"expects {P_MLP + 1}..{P_MLP + 1}" in msg, msg
    else:
        assert "boundary" in msg and "all_reduce int32" in msg, msg


# -- what the installed torch does ----------------------------------------------------------------

@needs_2
def test_static_graph_syncs_at_every_boundary():
    """The upstream report that DDP(static_graph=True) under no_sync stops all-reducing after its first
    iteration does NOT reproduce on torch 2.13 (CPU, gloo): over K=4 steps every boundary reduces the
    gradient once, and no micro-step before it reduces anything (but the declared warm-up and rebuild)."""
    case = Case(accum_steps=3, micro_batch=2, steps=4, world=2)
    r = check_distributed(ddp_modes.static_graph, case)
    for (rank, dt), steps in r.extra["comm"].steps.items():
        got = [s.boundary_elements for s in steps]
        assert got == [P_MLP + 1] * 4, (f"torch {TORCH}: static_graph + no_sync boundary reductions per step "
                                        f"{got}, expected {P_MLP + 1} each (rank {rank}, {dt})")
        micro = [[dict(families(m)) for m in s.micro] for s in steps]
        assert micro == [[{"all_reduce": 2}, {}], [{"broadcast": 2}, {}], [{}, {}], [{}, {}]], \
            f"torch {TORCH}: collectives before the boundary {micro} (rank {rank}, {dt})"


def test_static_graph_first_backward_under_no_sync_raises():
    """Why StaticGraph warms up: on torch 2.13 a DDP(static_graph=True) whose very first backward runs
    under no_sync() fails an internal assert (reducer.cpp, expect_autograd_hooks_); plain DDP does not."""
    pool = get_pool(1)
    assert pool.run(ddp_modes.first_backward_under_no_sync, static=False) == [None]
    err = pool.run(ddp_modes.first_backward_under_no_sync, static=True)[0]
    if err is None:
        pytest.skip(f"torch {TORCH}: no_sync() on static_graph's first backward no longer raises — "
                    f"StaticGraph's warm-up (and its first_micro row entry) may be unnecessary now")
    assert "expect_autograd_hooks_" in err, f"torch {TORCH}: a different error: {err}"


@needs_2
@pytest.mark.slow  # torch.compile's first use in a pool: ~5 s
def test_compiled_module_honours_no_sync():
    """The report that a torch.compile'd DDP module ignores no_sync (pytorch #109774) does NOT reproduce
    on torch 2.13 with backend aot_eager: only the boundary all-reduces (and the model really ran compiled:
    the trainer fails its step on any eager forward)."""
    case = Case(accum_steps=3, micro_batch=2, steps=2, world=2)
    r = check_distributed(ddp_modes.compiled, case)
    for (rank, dt), steps in r.extra["comm"].steps.items():
        micro = [[dict(families(m)) for m in s.micro] for s in steps]
        assert micro == [[{}, {}], [{"broadcast": 2}, {}]], \
            f"torch {TORCH}: compiled DDP's collectives before the boundary {micro} (rank {rank}, {dt})"
        got = [s.boundary_elements for s in steps]
        assert got == [P_MLP + 1] * 2, f"torch {TORCH}: boundary reductions per step {got} (rank {rank}, {dt})"


@needs_2
def test_a_compiled_mode_running_eagerly_fails():
    """The compiled trainer's own guard: a forward that ran outside a compiled graph fails the step."""
    with pytest.raises(DistJobError, match="torch.compile compiled nothing"):
        check_distributed(ddp_modes.compiled_runs_eager, Case(accum_steps=2, micro_batch=1, steps=1, world=2))


def test_compile_of_ddp_needs_a_module_with_its_own_forward():
    """Why ddp_modes' MLP is a class: torch.compile(DDP(m)) starts at m's forward frame, and torch.nn's own
    modules (nn.Sequential) are in dynamo's skip list — no graph at all on torch 2.13."""
    pool = get_pool(1)
    assert pool.run(ddp_modes.compiled_graphs, False)[0] >= 1, f"torch {TORCH}: DDP(MLP) compiled no graph"
    seq = pool.run(ddp_modes.compiled_graphs, True)[0]
    if seq:
        pytest.skip(f"torch {TORCH} compiles DDP(nn.Sequential) ({seq} graph(s)): ddp_modes' note is outdated")


# -- find_unused: an unused set that changes per micro-step ---------------------------------------

def _used(case):
    """(step, rank, micro) -> the experts the router uses there, from the harness's own sharding."""
    out = {}
    for k, (x, y) in enumerate(case.batches(ddp_modes.find_unused)):
        for r in range(case.world):
            for m, (xs, _) in enumerate(shard(x, y, case.accum_steps, r, case.world)):
                out[k, r, m] = frozenset(n for n, idx in Router.route(xs).items() if idx.numel())
    return out


def _patterns(case) -> set:
    used, N, W, out = _used(case), case.accum_steps, case.world, set()
    for k in range(case.steps):
        for e in "ab":
            ranks = {r for r in range(W) for m in range(N) if e in used[k, r, m]}
            if not ranks:
                out.add("unused in the whole window")
            elif not any(e in used[k, r, N - 1] for r in range(W)):
                out.add("used only in no_sync micro-steps")
            if 0 < len(ranks) < W:
                out.add("used on some ranks only")
    return out


def test_router_changes_its_unused_set_between_micro_steps():
    """The router's unused set is not fixed: over windows of N micro-steps × W ranks with B=1, distinct
    used-expert sets appear within one window, and some expert is unused in some micro-step."""
    case = Case(accum_steps=4, micro_batch=1, steps=3, world=2, data_seed=1)
    used = _used(case)
    for k in range(case.steps):
        sets = {used[k, r, m] for r in range(case.world) for m in range(case.accum_steps)}
        assert len(sets) >= 2, (k, sets)
    # the model agrees with the routing rule it is checked with
    model = Router().double()
    x, y = case.batches(ddp_modes.find_unused)[0]
    for m, (xs, _) in enumerate(shard(x, y, case.accum_steps, 0, case.world)):
        model(xs)
        assert frozenset(model.used) == used[0, 0, m]


PATTERNS = ("used only in no_sync micro-steps", "used on some ranks only", "unused in the whole window")


def _case_with(pattern: str) -> Case:
    """The first data seed whose window shows `pattern` and none of the other two (N=2, B=1, W=2, K=1)."""
    for ds in range(500):
        case = Case(accum_steps=2, micro_batch=1, steps=1, world=2, data_seed=ds, seed=ds)
        if _patterns(case) == {pattern}:
            return case
    raise AssertionError(f"no data seed < 500 gives {pattern!r} alone")


@needs_2
@pytest.mark.parametrize("pattern", PATTERNS)
def test_find_unused_gradient_is_right_when_the_unused_set_changes(pattern):
    """DDP(find_unused_parameters=True) + no_sync, an expert used only in micro-steps before the sync one,
    or only on some ranks, or by no one in the window: torch 2.13's boundary gradient matches the big
    batch (the reducer's used map accumulates over no_sync micro-steps; a globally unused expert keeps
    grad None, as in the reference)."""
    case = _case_with(pattern)
    r = check_distributed(ddp_modes.find_unused, case)
    assert r.ratio < 1, f"torch {TORCH}: {pattern}: {r.worst} at {r.ratio:.3f} of its bound; case {case}"


@needs_2
def test_dropped_expert_gradient_is_caught():
    """The gate would see it if DDP lost what an expert accumulated before the sync micro-step: the
    router that drops it is rejected by the equivalence gate, naming the expert's gradient."""
    case = _case_with("used only in no_sync micro-steps")
    with pytest.raises(GateFailure, match=r"gradient \(step 0\) of '[ab]\.0\.(weight|bias)'"):
        check_distributed(ddp_modes.router_drops_stale_expert, case)
