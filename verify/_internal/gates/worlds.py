"""Which worlds a run draws: the one rule, read by every gate test, the data-parallel gates and the self-test.

XTRAIN_DIST_MIN_WORLD..XTRAIN_DIST_MAX_WORLD (defaults 1..4), capped by GPUs under NCCL; under a launcher
(verify.run) the launched world. Design: docs/design/distributed.md, "Worlds".
"""
from __future__ import annotations

from verify._internal.ranks.pool import launched
from verify._internal.settings import Settings, current

__all__ = ["max_world", "min_world", "world_range", "needs_world"]


def max_world(settings: Settings | None = None) -> int:
    """World sizes the suite draws up to under `settings` (default settings.current()): XTRAIN_DIST_MAX_WORLD
    (default 4), capped by GPUs under NCCL; under a launcher (verify.run) the launched world, whatever the box's
    GPUs. A value the gate tests pass on to the strategies (dist_cases(max_world=...))."""
    world = getattr(launched(), "world", None)
    return world or (settings or current()).world_cap()


def min_world(adapter=None, settings: Settings | None = None) -> int:
    """The smallest world the suite draws: XTRAIN_DIST_MIN_WORLD (default 1), e.g. 8 to run only world 8. Under
    a launcher the launched world too, unless `adapter` declares subgroups (it reduces over Spec.group): then
    the worlds below run on subgroups of the launched ranks (LaunchedPool.sub), world 1 in a one-rank pool on
    rank 0's node as the references do. Without the declaration they would be pools spawned there, not launched."""
    world = getattr(launched(), "world", None)
    if world and not getattr(adapter, "subgroups", False):
        return world
    s = settings or current()
    return min(s.min_world, max_world(s))


def world_range(adapter=None, settings: Settings | None = None, at_least: int = 1) -> tuple[int, int]:
    """(lo, hi): the worlds a gate test draws, min_world(adapter)..max_world, none below `at_least` (2: a gate that
    needs two ranks). The one rule of which worlds run: every gate test and the self-test read it here."""
    s = settings or current()
    return max(at_least, min_world(adapter, s)), max_world(s)


def needs_world(at_least: int = 2, settings: Settings | None = None) -> str | None:
    """Why a gate that needs `at_least` ranks does not run under `settings`, or None where it does."""
    return None if max_world(settings) >= at_least else f"needs world ≥ {at_least} (XTRAIN_DIST_MAX_WORLD / GPUs)"
