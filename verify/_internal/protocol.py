"""What the harness drives, and how a user hands it their trainer.

A trainer implements four methods and the harness owns the loop around them (`Trainer` below: each method's
contract). An `Adapter` declares everything else the harness needs (data, plain step, options, data parallelism,
collectives, precisions, padding, meshes, objective, the memory model) without knowing the model, loss or
optimizer. Each declaration is described once, in docs/verify-your-trainer.md ("Declarations").
"""
from __future__ import annotations

import dataclasses
import gc
import importlib
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from verify._internal.atstep import GRADS_FROM, OptimizerGrads
from verify._internal.declare import (FLAT, AdapterError, Batches, Distributed, MemoryModel, Numerics, Parity,
                                      Threshold, callables, declared_fields, regroup)
from verify._internal.expected import DDP_EXPECTED, DDP_WORLD1_EXPECTED, Expected
from verify._internal.metrics import Metrics
from verify._internal.objective import Objective
from verify._internal.precision import AUTOCAST, Precision
from verify._internal.ranks.mesh import Mesh, check_spec
from verify._internal.verdict import raised_at

__all__ = ["Trainer", "Spec", "Adapter", "Expected", "DDP_EXPECTED", "DDP_WORLD1_EXPECTED", "adapter", "load_adapter",
           "AdapterError", "Precision", "AUTOCAST", "Batches", "Distributed", "Numerics", "MemoryModel",
           "Threshold"]


@runtime_checkable
class Trainer(Protocol):
    """The four methods the harness drives, in this order per window of N = Spec.accum_steps micro-steps:
    micro_step() × N, grads(), optimizer_step(), params(). Optional: partial_grads() (what grads() would return
    if the window ended now, as new tensors), loss_scale() (the fp16 GradScaler's scale now) and metrics()
    (what the trainer logged for the step just taken, {name: float}, as Adapter(metrics=verify.Metrics(...))
    declares)."""
    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, micro: int) -> None:
        """One micro-batch (micro = 0..N-1): forward, loss, backward; accumulate, never step. inputs / targets are
        this rank's rows, rows first, on Spec.device, floating ones in Spec.dtype, the trainer's own copies: never
        write into them. Data parallel: communicate only in micro-step N-1 (or as Adapter expected / counts say)."""
    def grads(self) -> dict[str, torch.Tensor]:
        """{name: tensor}, once per window after micro-step N-1: the accumulated gradient the optimizer will step
        with, after every normalisation (÷ N, ÷ W, ÷ the token count) and BEFORE clipping (pre-clip). Live .grad
        tensors are fine. A trainer that divides inside optimizer_step() declares Adapter(grads_from="optimizer")."""
    def optimizer_step(self) -> torch.Tensor | float | None:
        """Clip, step, schedule, zero_grad, once per window; returns the step loss, the mean over the whole window
        and every rank: a python float or a 0-d tensor of any floating dtype (read as float(loss); float64 in a
        float64 run). NaN for a window without a valid target; None only on a rank that lacks it (a pipeline's
        earlier stages)."""
    def params(self) -> dict[str, torch.Tensor]:
        """{name: tensor} of every parameter, any time; the names of grads(). On a mesh: what the rank owns,
        under the full model's names (DTensors are fine)."""


@dataclass(frozen=True, kw_only=True)
class Spec:
    """What a factory is told. It builds a fresh model (init from `seed`, in `dtype`, on `device`), its
    optimizer and schedule, and a trainer that runs `accum_steps` micro-steps per optimizer step."""

    accum_steps: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    options: Any = None
    """The adapter's own knobs, drawn from its `options` strategy (None when it declares none)."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 (autocast; parameters in `dtype`): one of the adapter's `precisions`.
    Float64 runs (the references) always come with "fp32": no autocast."""
    schedule_world: int = 1
    """For adapters that declare `scheduler_per_rank`: the world size W whose per-rank scheduler stepping
    this trainer must show (its LR scheduler advances W times per optimizer step). It is W in a W-rank run
    AND in the one-process reference that run is compared with; 1 for adapters that declare nothing. A trainer
    reads `scheduler_calls` (below): the step() calls per optimizer step that follow from it."""
    mesh: Mesh = Mesh()  # dp × pp × tp ranks (Adapter.mesh_axes, verify/_internal/ranks/mesh.py); Mesh() in every reference
    pipeline_chunks: int = 1  # micro-batches per pipeline schedule.step (buffered micro_steps); divides accum_steps
    terms: tuple[str, ...] | None = None  # the objective's terms the loss must hold (Adapter.objective); None: all
    windows: tuple[int, ...] | None = None
    """For adapters that declare `short_last_window`: the micro-batches of each window of this run, in order —
    accum_steps each, but the last may hold fewer (an epoch N does not divide). Read it through `window(k)`.
    None for adapters that declare nothing: every window holds accum_steps."""
    group: Any = field(default=None, compare=False, repr=False)
    """The process group to reduce over; None: the default group. Given on the rank, only to adapters that
    declare `subgroups`, in a launched world's sub-world; never pickled (a group lives in one process)."""

    def __post_init__(self):
        check_spec(self)
        w, n = self.windows, self.accum_steps
        if w is not None and not (w and all(isinstance(m, int) and 1 <= m <= n for m in w) and set(w[:-1]) <= {n}):
            raise ValueError(f"Spec.windows must list each window's micro-batches: accum_steps={n} each, the last "
                             f"1..{n}; got {w!r}")

    def window(self, k: int) -> int:
        """The micro-batches of window k (0-based): windows[k], else accum_steps (nothing declared, or past the list)."""
        return self.windows[k] if self.windows is not None and k < len(self.windows) else self.accum_steps

    def __getstate__(self):
        return {**self.__dict__, "group": None}

    @property
    def scheduler_calls(self) -> int:
        """For adapters that declare `scheduler_per_rank`: how many times to call the per-rank scheduler's
        step() per optimizer step. Each call advances it once per process (Accelerate: num_processes times),
        so it is schedule_world // this run's processes (torch.distributed's world, of `group` if given):
        1 in a W-rank run, W in its one-process reference, 1 for adapters that declare nothing."""
        import torch.distributed as dist

        processes = dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1
        return max(1, self.schedule_world // processes)


def _one_positional(fn) -> bool:
    """True when fn can be called with exactly one positional argument."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True  # builtins, C callables: trust them
    try:
        sig.bind(None)
        return True
    except TypeError:
        return False


@dataclass(frozen=True, eq=False)
class Adapter:
    """A trainer factory plus what the harness needs to know of it, one declaration per concern (module
    docstring; declare.py). The flat keywords of earlier releases (`ignore_index=`, `data_parallel=`, ...)
    still build and read: each is its group's field (declare.FLAT)."""

    factory: Callable[[Spec], Trainer]
    data: Callable
    plain: Callable[[Spec], Trainer] | None = None
    options: Any = None  # a hypothesis SearchStrategy, or None
    defaults: Any = None
    name: str = ""
    batches: Batches = Batches()
    distributed: Distributed = Distributed()
    numerics: Numerics = Numerics()
    memory: MemoryModel = MemoryModel()
    metrics: Metrics | None = None
    """What the trainer's metrics() reports per optimizer step and its conventions (the metrics gate); None:
    metrics are not checked, and the report says so."""
    objective: Objective | None = None
    """How each term of the loss normalises (the normaliser gate); None: a token mean with an ignore_index,
    else a row mean that only the split-based gates judge."""
    parity: Parity | None = None  # a switch of the options that must not change the result (gates/parity.py)
    thresholds: tuple[Threshold, ...] = ()  # sizes past which the stack takes another path: drawn on both sides
    grads_from: str = "grads"  # "grads": grads(); "optimizer": .grad as optimizer step() begins (atstep.py)
    unclipped: Callable | None = None
    """options -> the same options with gradient clipping off: lets a failure's diagnosis re-run it unclipped."""
    ref: str | None = field(default=None, compare=False)
    """'module:attribute' this adapter is importable as; found on first use when not given."""
    mutation: Any = None
    """Set by the self-test: the fault operator wrapped around `factory`, an object with `name` and
    `apply(adapter)` that pickles by reference (verify.selftest.operators.Operator); pool ranks rebuild the
    mutant through it, so the protocol needs no import of the self-test."""

    def __post_init__(self):
        for what in ("factory", "data"):
            if not callable(getattr(self, what)):
                raise AdapterError(f"adapter {what} must be callable, got {getattr(self, what)!r}")
        if not _one_positional(self.factory):
            raise AdapterError(f"the factory {_qual(self.factory)} must take one argument (a verify.Spec)")
        if self.plain is not None and not (callable(self.plain) and _one_positional(self.plain)):
            raise AdapterError(f"plain= must be a factory taking one argument (a verify.Spec), got {self.plain!r}")
        for f, kind in (("metrics", Metrics), ("objective", Objective), ("parity", Parity)):
            if getattr(self, f) is not None and not isinstance(getattr(self, f), kind):
                raise AdapterError(f"{f}= must be a verify.{kind.__name__}(...), got {getattr(self, f)!r}")
        given = (self.thresholds,) if isinstance(self.thresholds, Threshold) else tuple(self.thresholds)
        if any(not isinstance(t, Threshold) for t in given):
            raise AdapterError(f"thresholds= must hold verify.Threshold(name=..., apply=...), got {self.thresholds!r}")
        object.__setattr__(self, "thresholds", given)
        if self.metrics is not None and self.ignore_index is None and "tokens" in self.metrics.names:
            raise AdapterError("Metrics.names has 'tokens' but the adapter declares no ignore_index: report 'rows', "
                               "or declare Batches(ignore_index=...) so the harness can count valid targets")
        if self.grads_from not in GRADS_FROM:
            raise AdapterError(f"grads_from must be one of {', '.join(map(repr, GRADS_FROM))}, got {self.grads_from!r}")
        callables(self, unclipped="(options -> options without clipping)")
        if not self.name:
            object.__setattr__(self, "name", self.ref or _qual(self.factory))

    def __getattr__(self, name: str):  # only for names that are not fields: a flat name reads its group's field
        group = FLAT.get(name)
        if group is None:
            raise AttributeError(f"'Adapter' object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, group), name)

    def __repr__(self):
        return f"Adapter({self.name!r}{', ' + self.mutation.name if self.mutation is not None else ''})"

    def declarations(self) -> dict:
        """Every declaration that changes what the gates expect, by its flat name (the report lists them)."""
        out = {} if self.plain is None else {"plain": self.plain}
        out.update(declared_fields(self, skip=("memory",)))
        if self.ignore_index is None:
            out.pop("empty_windows", None)  # means nothing without padding
        if not self.data_parallel:
            out.pop("subgroups", None), out.pop("uneven", None)  # mean nothing without data parallelism
        if self.grads_from != "grads":
            out["grads_from"] = self.grads_from
        out.update({f: getattr(self, f) for f in ("metrics", "objective", "parity") if getattr(self, f) is not None})
        if self.thresholds:
            out["thresholds"] = [t.name for t in self.thresholds]
        return {f: (_qual(v) if callable(v) else [dataclasses.asdict(e) for e in v] if f == "expected"
                    else list(v) if isinstance(v, tuple) else {a: list(n) for a, n in v.items()}
                    if f == "mesh_sizes" else v.declared() if f in ("metrics", "objective") else v)
                for f, v in out.items() if v is not None and v != ()}

    def __call__(self, spec: Spec) -> Trainer:
        if str(spec.device).startswith("cuda"):
            gc.collect()  # the last run's trainer, held by its own reference cycles (modules, hooks, closures), goes first
        trainer = self.factory(spec)
        missing = missing_methods(trainer)
        if missing:
            raise AdapterError(_no_trainer(self.name, trainer, missing))
        return OptimizerGrads(trainer) if self.grads_from == "optimizer" else trainer

    def check_factory(self, device: str = "cpu", *, option: str = "--verify-trainer", raises: bool = False) -> None:
        """Up front, before any gate: AdapterError (one line, naming `option`) when the factory's trainer lacks
        a method of the protocol. A single-process adapter builds one trainer (accum_steps 1, float32, its
        defaults). A data-parallel one is not built in the invoking process (frameworks start loops, install
        signal handlers, read the launcher's environment): its trainer class is checked, or the class its
        factory is annotated to return; otherwise its first build in a gate raises the same AdapterError
        (__call__). raises=True (the plugin's start-up): a factory raising on that build is an AdapterError
        naming the exception and its file:line; otherwise the gates report it, with the case."""
        try:
            ret = inspect.signature(self.factory).return_annotation
        except (TypeError, ValueError):
            ret = None
        if not self.data_parallel and (self.options is None or self.defaults is not None):
            try:
                obj = self.factory(Spec(accum_steps=1, device=device, options=self.defaults))
            except Exception as e:  # noqa: BLE001
                if raises:
                    raise AdapterError(f"{option} {self.ref or self.name}: {_qual(self.factory)} raised building a "
                                       f"trainer (accum_steps=1, float32, its defaults): {raised_at(e)}; fix the "
                                       f"factory or what it reads") from None
                return
        elif isinstance(self.factory, type):
            obj = self.factory
        elif isinstance(ret, type) and ret is not inspect.Signature.empty:
            obj = ret
        else:
            return
        missing = missing_methods(obj)
        if missing:
            raise AdapterError(f"{option} {self.ref or self.name}: " + _no_trainer(_qual(self.factory), obj, missing))

    def replace(self, **changes) -> "Adapter":
        """A copy with `changes` (flat names too: each replaces its group's field, the rest of the group kept)."""
        changes.setdefault("ref", None)
        changes.setdefault("name", "")
        return dataclasses.replace(self, **regroup(changes, base=self))

    def batch(self, rows: int, seed: int, options=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows` rows of (inputs, targets) for `seed`, on the CPU."""
        try:
            n = len(inspect.signature(self.data).parameters)
        except (TypeError, ValueError):
            n = 3
        out = self.data(rows, seed, options) if n >= 3 else self.data(rows, seed)
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
            raise AdapterError(f"data of {self.name} must return (inputs, targets) tensors, got {type(out).__name__}")
        if out[0].shape[0] != rows or out[1].shape[0] != rows:
            raise AdapterError(f"data of {self.name} returned {out[0].shape[0]} / {out[1].shape[0]} rows, asked for {rows}")
        return out[0], out[1]

    # -- pickling: pools rebuild an adapter by importing its reference (strategies do not pickle) --------
    def locate(self) -> str:
        if self.ref is None:
            mod = sys.modules.get(getattr(self.factory, "__module__", None) or "")
            for name, value in vars(mod or object()).items():
                if value is self:
                    object.__setattr__(self, "ref", f"{mod.__name__}:{name}")
                    break
            else:
                raise AdapterError(f"adapter {self.name} is not a module-level name: define it at module level "
                                   "so worker processes can import it")
        return self.ref

    def __reduce__(self):
        return _rebuild, (self.locate(), self.mutation)


_fields_init = Adapter.__init__


def _init(self, *args, **changes):  # Adapter(..., ignore_index=-100): the flat keywords fold into their groups
    _fields_init(self, *args, **regroup(changes))


Adapter.__init__ = _init

TRAINER_METHODS = ("micro_step", "grads", "optimizer_step", "params")  # verify.Trainer, in call order


def missing_methods(obj) -> list[str]:
    """The methods of the trainer protocol that `obj` (a trainer, or its class) does not have."""
    return [m for m in TRAINER_METHODS if not callable(getattr(obj, m, None))]


def _no_trainer(factory: str, obj, missing: list[str]) -> str:
    what = obj.__name__ if isinstance(obj, type) else f"a {type(obj).__name__}"
    return (f"{factory} makes {what} without {', '.join(m + '()' for m in missing)}; a trainer needs "
            f"{', '.join(m + '()' for m in TRAINER_METHODS)} (verify.Trainer)")


def _rebuild(ref: str, mutation) -> Adapter:
    return load_adapter(ref) if mutation is None else mutation.apply(load_adapter(ref))


def _qual(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def adapter(*, data, **declared):
    """Decorator: `@adapter(data=...) def factory(spec): ...` makes `factory` an Adapter; so does
    `factory = adapter(data=...)(MyTrainer)` for a trainer class whose constructor takes the Spec. The
    keywords are Adapter's fields (and the flat names of earlier releases, which Adapter folds: declare.FLAT)."""
    fields = {f.name for f in dataclasses.fields(Adapter)} - {"factory", "data", "ref", "mutation"}
    unknown = sorted(set(declared) - fields - set(FLAT))
    if unknown:
        raise AdapterError(f"adapter() has no declaration {unknown[0]!r}; declarations: {', '.join(sorted(fields))} "
                           f"(docs/verify-your-trainer.md, Declarations)")

    def wrap(fn) -> Adapter:  # fn: a function or a trainer class, Spec -> trainer
        return Adapter(factory=fn, data=data, **{**declared, "name": declared.get("name") or f"{fn.__module__}.{fn.__qualname__}"})

    return wrap


_LOADED: list[str] = []  # the modules load_adapter imported, in order


def loaded_modules() -> list[str]:  # the trainer modules load_adapter has imported in this process
    return list(_LOADED)


def load_adapter(ref: str, *, option: str = "--verify-trainer") -> Adapter:
    """'MODULE:NAME' -> the Adapter it names. The invoking directory is importable (as with `python -m`).
    AdapterError (one line, naming `option`) for a missing module or name, or a wrong kind of object."""
    if not isinstance(ref, str) or ref.count(":") != 1 or not all(ref.split(":")):
        raise AdapterError(f"{option} {ref}: expected MODULE:FACTORY, e.g. mypkg.train:factory")
    mod_name, attr = ref.split(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as e:
        raise AdapterError(f"{option} {ref}: cannot import {mod_name!r} ({e}); run from the directory that "
                           f"contains it or install it") from None
    except Exception as e:  # noqa: BLE001  (the user's module raised while importing)
        raise AdapterError(f"{option} {ref}: importing {mod_name!r} raised {type(e).__name__}: {e}") from None
    if mod_name not in _LOADED:
        _LOADED.append(mod_name)  # the gloo pools' forkserver imports it too (verify._internal.ranks.pool)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AdapterError(f"{option} {ref}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if isinstance(obj, Adapter):
        if obj.ref is None:
            object.__setattr__(obj, "ref", ref)
        return obj
    if not callable(obj):
        raise AdapterError(f"{option} {ref}: {attr!r} is a {type(obj).__name__}, not callable; name a factory Spec -> trainer")
    if not _one_positional(obj):
        raise AdapterError(f"{option} {ref}: {attr}{_sig(obj)} must take exactly one argument (a verify.Spec)")
    raise AdapterError(f"{option} {ref}: {attr!r} is a plain function; declare its data with "
                       f"@verify.adapter(data=...) so the harness knows what batches to draw")


def _sig(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):  # a builtin or C callable without one
        return "(...)"
