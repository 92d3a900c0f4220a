"""Declared objectives: how each term of a trainer's loss is normalised, so the normaliser gate
(gates/objective.py) can check it against the counts the harness knows.

A term's normaliser fixes its weight in a window, the number that makes windows add up:
w(A)·L(A) + w(B)·L(B) = w(A∪B)·L(A∪B) for disjoint windows A, B at the same parameters. The one table of
what each divides by and what a split may change is docs/design/numerics.md, "Normalisers".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from verify._internal.declare import AdapterError

__all__ = ["Objective", "NORMALISERS", "Normaliser", "objective_of", "window_terms", "Weights", "non_equivalences"]


@dataclass(frozen=True)
class Normaliser:
    """One way a term divides: `weight` names the count w of a window (rows, valid targets, sequences, or
    1 for a sum); `padding` says what a row without a valid target adds to w (its row or sequence counts,
    or nothing); `in_row`: how the halves of one sequence's valid targets add up (their valid counts, or
    plainly: a sum over tokens), None where a row cannot be split (a row mean); `additive` False: a term
    nonlinear in its window (a load-balancing loss of the whole batch), judged only against the big batch."""

    name: str
    means: str
    weight: str
    padding_counts: bool
    in_row: str | None
    additive: bool = True


NORMALISERS = {n.name: n for n in [
    Normaliser("row_mean", "Σ over rows of each row's loss / rows", "rows", True, None),
    Normaliser("token_mean", "Σ over valid targets / their number", "valid targets", False, "valid"),
    Normaliser("seq_mean", "Σ over sequences of each one's token mean / sequences (an empty one counts)",
               "sequences", True, "valid"),
    Normaliser("seq_sum", "Σ over valid targets / (sequences × a constant) (Dr. GRPO)", "sequences", True, "sum"),
    Normaliser("sum", "Σ over valid targets (no normaliser)", "1", False, "sum"),
    Normaliser("batch", "a function of the whole window (a global-batch load-balancing loss)", "—", False, None,
               additive=False),
]}


@dataclass(frozen=True, kw_only=True)
class Objective:
    """How the loss normalises, term by term: `terms` {name: normaliser} (NORMALISERS); `per_micro` the terms
    computed per micro-batch and averaged over the micro-steps (a declared non-equivalence: every other gate
    judges the loss without them, Spec.terms); `sequences` (inputs, targets) -> int64 (rows,): how many
    sequences each row holds (packed documents; verify.data.count_documents), None: one per row; `segments`
    (inputs, targets) -> int64 (rows, S): the sequence of each target position, so one sequence of a packed row
    can be halved (default: the sequences callable's own `.segments`, as count_documents has). With more than
    one term, or a per-micro one, the factory builds a loss of only the terms Spec.terms names."""

    terms: Mapping[str, str] = field(default_factory=lambda: {"loss": "token_mean"})
    per_micro: tuple[str, ...] = ()
    sequences: Callable | None = None
    segments: Callable | None = None

    def __post_init__(self):
        if not isinstance(self.terms, Mapping) or not self.terms:
            raise AdapterError(f"Objective.terms must be a non-empty {{name: normaliser}}, got {self.terms!r}")
        for name, kind in self.terms.items():
            if kind not in NORMALISERS:
                raise AdapterError(f"Objective.terms[{name!r}] must be one of {', '.join(NORMALISERS)}, got {kind!r}")
        object.__setattr__(self, "terms", dict(self.terms))
        micro = (self.per_micro,) if isinstance(self.per_micro, str) else tuple(self.per_micro)
        unknown = [t for t in micro if t not in self.terms]
        if unknown:
            raise AdapterError(f"Objective.per_micro names {unknown[0]!r}, not one of its terms ({', '.join(self.terms)})")
        if len(micro) == len(self.terms):
            raise AdapterError("Objective.per_micro names every term: nothing is left to compare with the big batch; "
                               "declare at least one window-level term")
        object.__setattr__(self, "per_micro", micro)
        if self.sequences is not None and not callable(self.sequences):
            raise AdapterError(f"Objective.sequences must be callable (inputs, targets) -> sequences per row, "
                               f"got {self.sequences!r}")
        if self.segments is None:
            object.__setattr__(self, "segments", getattr(self.sequences, "segments", None))
        if self.segments is not None and not callable(self.segments):
            raise AdapterError(f"Objective.segments must be callable (inputs, targets) -> the sequence of each target "
                               f"position (rows, S), got {self.segments!r}")

    @property
    def split(self) -> bool:
        """Whether the factory must honour Spec.terms (more than one term, or a per-micro one)."""
        return len(self.terms) > 1 or bool(self.per_micro)

    def declared(self) -> dict:
        """The report's line."""
        out: dict[str, Any] = {"terms": dict(self.terms)}
        if self.per_micro:
            out["per_micro"] = list(self.per_micro)
        if self.sequences is not None:
            out["sequences"] = f"{self.sequences.__module__}.{self.sequences.__qualname__}"
        if self.segments is not None and self.segments is not getattr(self.sequences, "segments", None):
            out["segments"] = f"{self.segments.__module__}.{self.segments.__qualname__}"
        return out


def objective_of(adapter) -> Objective | None:
    """The adapter's declared objective; undeclared, a token mean for an adapter with an ignore_index (what
    the harness has always assumed of one), else None (a row mean, checked by the other gates alone)."""
    if adapter.objective is not None:
        return adapter.objective
    return Objective() if adapter.ignore_index is not None else None


def window_terms(adapter) -> tuple[str, ...] | None:
    """The Spec.terms every gate but the normaliser gate runs with: the window-level terms where some are
    per micro-batch (those differ from the big batch by declaration), else None (every term)."""
    obj = adapter.objective
    if obj is None or not obj.per_micro:
        return None
    return tuple(t for t in obj.terms if t not in obj.per_micro)


def non_equivalences(declared: dict | None) -> list[str]:
    """One line per declared per-micro-batch term (from Adapter.declarations()["objective"]), as the report and
    the terminal say it: a true non-equivalence, like BatchNorm's per-micro-batch statistics."""
    obj = declared or {}
    return [f"term {t!r} vs the big batch: declared per micro-batch (per_micro), a different objective from the big "
            f"batch's, so every gate but the normaliser judges the loss without it (the normaliser gate checks it is "
            f"each micro-batch's own value averaged over the micro-steps); for equivalence compute it over the whole "
            f"window instead ({_window_level(obj['terms'][t])})" for t in obj.get("per_micro", [])]


def _window_level(kind: str) -> str:
    if kind == "batch":  # already a global-batch term: only its counts' scope changes
        return "drop it from per_micro: its counts over every micro-step and rank, a global-batch term"
    return f"a global-batch term: declare {kind!r} window-level, or 'batch'"


class Weights:
    """A window's counts, as the harness knows them from the targets it hands out: rows, valid targets,
    sequences (Objective.sequences, else rows)."""

    def __init__(self, adapter, objective: Objective):
        self.ignore, self.sequences, self.segments = adapter.ignore_index, objective.sequences, objective.segments

    def of(self, kind: str, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        weight = NORMALISERS[kind].weight
        if weight == "1":
            return 1.0
        if weight == "rows":
            return float(targets.shape[0])
        if weight == "valid targets":
            return float((targets != self.ignore).sum()) if self.ignore is not None else float(targets.numel())
        if self.sequences is None:
            return float(targets.shape[0])
        return float(torch.as_tensor(self.sequences(inputs, targets)).sum())
