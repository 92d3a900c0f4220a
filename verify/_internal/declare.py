"""What an adapter declares, grouped by concern: one frozen dataclass per concern, each validating itself.

    Batches      what the data may hold: padding, windows without a valid target, a short last window
    Distributed  how the trainer talks: data parallelism, its group, what it sends before the boundary, meshes
    Numerics     the autocast precisions it supports, how an fp16 overflow is made, a native (no float64) reference
    MemoryModel  what `python -m verify.memory` predicts and offers for it

`verify.Metrics`, `verify.Objective` and `verify.Parity` are declarations of their own. A new feature adds one
field to one group: `Adapter`'s flat keywords of earlier releases (`ignore_index=`, `data_parallel=`, ...)
are derived from these fields (FLAT), so old adapters keep working and no list of names moves with a feature.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from verify._internal.expected import Expected
from verify._internal.precision import Precision
from verify._internal.ranks.mesh import mesh_axes as _axes, mesh_sizes as _sizes

__all__ = ["AdapterError", "Batches", "Distributed", "Numerics", "NATIVE", "MemoryModel", "Parity", "Threshold", "GROUPS", "FLAT",
           "regroup", "declared_fields", "flag", "callables"]


class AdapterError(ValueError):
    """A trainer reference or adapter declaration that cannot be used; str(e) is one line."""


def flag(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise AdapterError(f"{owner}.{name} must be True or False, got {value!r}")


def callables(owner, **shapes: str) -> None:
    """AdapterError unless each named field of `owner` is None or callable (its shape in words)."""
    for name, shape in shapes.items():
        value = getattr(owner, name)
        if value is not None and not callable(value):
            raise AdapterError(f"{type(owner).__name__}.{name} must be callable {shape}, got {value!r}")


def switch(owner, side: str) -> None:
    """A declared switch of the options (Parity, Threshold): a non-empty `name`, and `apply(options, side: bool)`."""
    kind = type(owner).__name__
    if not isinstance(owner.name, str) or not owner.name:
        raise AdapterError(f"{kind}.name must be a non-empty string, got {owner.name!r}")
    callables(owner, apply=f"(options, {side}: bool) -> options")


@dataclass(frozen=True, kw_only=True)
class Batches:
    """What the data may hold. `ignore_index`: the padding target (e.g. -100), claiming the token mean over the
    window and every rank unless Objective says otherwise; `empty_windows=False`: never feed the trainer a window
    without a valid target; `short_last_window`: one process, a run may end with a window of fewer micro-batches
    (Spec.windows), normalised by its own count."""

    ignore_index: int | None = None
    empty_windows: bool = True
    short_last_window: bool = False

    def __post_init__(self):
        if self.ignore_index is not None and (not isinstance(self.ignore_index, int) or isinstance(self.ignore_index, bool)):
            raise AdapterError(f"Batches.ignore_index must be an integer (the padding target, e.g. -100) or None, "
                               f"got {self.ignore_index!r}")
        flag("Batches", "empty_windows", self.empty_windows)
        flag("Batches", "short_last_window", self.short_last_window)


@dataclass(frozen=True, kw_only=True)
class Distributed:
    """How the trainer talks. `data_parallel`: it reduces over torch.distributed's default group when one exists;
    `process_group`: it needs a group even alone (DDP), implying data_parallel; `subgroups`: it honours
    Spec.group; `uneven`: it normalises by the GLOBAL count, so ranks may hold unequal rows; `expected`: the
    collectives it may issue before the boundary; `counts`: case -> verify.CountRow, a sync mode's exact
    collectives ({axis: CountRow} on a mesh); `counts64`: the float64 reference's row, where that run takes
    another mode (a stage the framework can run in float64; default: counts at fp32); `scheduler_per_rank`: its
    LR scheduler steps once per rank per optimizer step (Spec.schedule_world); `mesh_axes`, `mesh_sizes`: the axes beyond dp and the sizes it shards to."""

    data_parallel: bool = False
    process_group: bool = False
    subgroups: bool = False
    uneven: bool = False
    expected: tuple[Expected, ...] = ()
    counts: Callable | None = None
    counts64: Callable | None = None
    scheduler_per_rank: bool = False
    mesh_axes: tuple[str, ...] = ()
    mesh_sizes: dict | None = None

    def __post_init__(self):
        for f in ("data_parallel", "process_group", "subgroups", "uneven", "scheduler_per_rank"):
            flag("Distributed", f, getattr(self, f))
        expected = tuple(self.expected) if isinstance(self.expected, (tuple, list)) else (self.expected,)
        if any(not isinstance(e, Expected) for e in expected):
            raise AdapterError(f"Distributed.expected must hold verify.Expected(op, ...) entries, got {self.expected!r}")
        object.__setattr__(self, "expected", expected)
        callables(self, counts="(case -> verify.CountRow)", counts64="(case -> verify.CountRow)")
        object.__setattr__(self, "mesh_axes", _axes(self.mesh_axes, AdapterError))
        object.__setattr__(self, "mesh_sizes", _sizes(self.mesh_sizes, self.mesh_axes, AdapterError))
        if self.process_group:
            object.__setattr__(self, "data_parallel", True)


NATIVE = ("fp8", "bf16", "fp16", "fp32")  # a native reference's precisions (gates/native.py: each one's epsilon)


@dataclass(frozen=True, kw_only=True)
class Numerics:
    """`precisions`: the autocast precisions the trainer supports, among fp32, bf16, fp16 (the gates draw among
    them); `overflow`: fp16, (trainer, inputs, targets, rows) -> (inputs, targets) making those rows overflow
    (None: the harness writes an inf into that micro-step's backward); `native`: the trainer has no float64 path
    (FP8 training, fused kernels), so its gates judge it against its own runs, never a float64 one: the precision
    of its coarsest kernels, among NATIVE (docs/design/tolerance.md, "The native reference")."""

    precisions: tuple[str, ...] = ("fp32",)
    overflow: Callable | None = None
    native: str | None = None

    def __post_init__(self):
        if self.native is not None and self.native not in NATIVE:
            raise AdapterError(f"Numerics.native must be one of {', '.join(NATIVE)} (the precision of the trainer's "
                               f"coarsest kernels) or None (a float64 reference), got {self.native!r}")
        given = (self.precisions,) if isinstance(self.precisions, str) else tuple(self.precisions)
        if not given or any(p not in tuple(Precision) for p in given):
            raise AdapterError(f"Numerics.precisions must be a non-empty subset of fp32, bf16, fp16, got {self.precisions!r}")
        object.__setattr__(self, "precisions", tuple(Precision(p) for p in given))
        callables(self, overflow="(trainer, inputs, targets, rows) -> (inputs, targets)")


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """`predicted_peak`: verify.memory.PeakQuery -> Prediction | str, the trainer's memory model for
    `python -m verify.memory`; `memory_preset`: what that command adds for the trainer's family when it is the
    configured default trainer (a verify.memory.cli.Wing)."""

    predicted_peak: Callable | None = None
    memory_preset: Any = None

    def __post_init__(self):
        callables(self, predicted_peak="(PeakQuery -> Prediction | str)")


@dataclass(frozen=True, kw_only=True)
class Parity:
    """A switch that must not change the result: `name` (as messages say it), `apply(options, on)` -> the
    adapter's options with the switch on or off (options is the drawn value, None without an options strategy);
    `exact`: the math is the same on both sides, so bit-equality; False: the precision bound applies."""

    name: str
    apply: Callable[[Any, bool], Any]
    exact: bool = True

    def __post_init__(self):
        switch(self, "on")
        flag("Parity", "exact", self.exact)


@dataclass(frozen=True, kw_only=True)
class Threshold:
    """A size past which the trainer's stack takes another path (DDP's gradient bucket cap, ZeRO-3's parameter
    persistence threshold, a chunked loss's chunk length): `name` (as reports say it), `apply(options, above)` -> the
    adapter's options with the size on that side of it (options is the drawn value, None without an options
    strategy). Every gate then also runs its first corner on both sides."""

    name: str
    apply: Callable[[Any, bool], Any]

    def __post_init__(self):
        switch(self, "above")


# the Adapter's group fields, their classes and what an adapter that declares nothing holds
GROUPS: dict[str, tuple[type, Any]] = {"batches": (Batches, Batches()), "distributed": (Distributed, Distributed()),
                                       "numerics": (Numerics, Numerics()), "memory": (MemoryModel, MemoryModel())}
# flat keyword of earlier releases -> its group (derived: a feature's new field needs no entry here)
FLAT: dict[str, str] = {f.name: g for g, (cls, _) in GROUPS.items() for f in dataclasses.fields(cls)}


def regroup(changes: dict, base=None) -> dict:
    """Adapter keywords with every flat one (FLAT) folded into its group: the group given in `changes`, else
    `base`'s (an Adapter), else the empty declaration's. A group given in its own right must be its class."""
    out = {k: v for k, v in changes.items() if k not in FLAT}
    for g, (cls, empty) in GROUPS.items():
        flat = {k: v for k, v in changes.items() if FLAT.get(k) == g}
        if g in out and out[g] is not None and not isinstance(out[g], cls):
            raise AdapterError(f"{g}= must be a verify.{cls.__name__}(...), got {out[g]!r}")
        if out.get(g) is None and g in changes:
            out[g] = empty  # None: the empty declaration
        if flat:
            start = out.get(g) or (getattr(base, g) if base is not None else empty)
            out[g] = dataclasses.replace(start, **flat)  # the group's own check names Group.field
    return out


def declared_fields(adapter, skip=()) -> dict:
    """Every group field an adapter declares (not its empty declaration's value), by its flat name."""
    out = {}
    for g, (cls, empty) in GROUPS.items():
        if g in skip:
            continue
        value = getattr(adapter, g)
        for f in dataclasses.fields(cls):
            v = getattr(value, f.name)
            if v != getattr(empty, f.name):
                out[f.name] = v
    return out

