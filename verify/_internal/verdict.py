"""The verdict types: which gate, and what it found. The bottom layer (stdlib only): every gate, the
harness's loop (case.py), the report, the hints, the self-test and the plugin read verdicts from here.

A gate has ONE name, the value of its `Gate` member. It is the `[...]` that opens every failure message,
the report's key (`equivalence`, `equivalence@bf16`, ...) and the self-test's column. Nothing recovers a
gate from message text: `GateFailure.gate` and `GateResult.gate` carry the member.
"""
from __future__ import annotations

from enum import StrEnum

__all__ = ["Gate", "GateFailure", "GateSkipped", "GateResult", "bare"]


class Gate(StrEnum):
    """Every gate, by the one name used in messages, report keys and self-test columns."""

    EQUIVALENCE = "equivalence"  # N micro-steps vs the same trainer's big batch (gates/single.py)
    BIT_EXACT = "bit-exact"  # accum_steps=1 vs the adapter's plain step, torch.equal (gates/single.py)
    SPLIT_INVARIANCE = "split invariance"  # every (N, B, W) split of one window (gates/windows.py)
    PARTIAL_SUMS = "partial sums"  # partial_grads() after every micro-step (gates/windows.py)
    LONG_WINDOW = "long window"  # equivalence at N up to 256 in a declared low precision (gates/windows.py)
    NORMALISER = "normaliser"  # each term divides by its declared count: windows add up, padding as declared (gates/objective.py)
    EMPTY_WINDOW = "empty window"  # a window without a valid target changes nothing (gates/tokens.py)
    BOUNDARY_ONLY = "boundary-only"  # the collective counter's verdict (gates/distributed.py)
    DP_EQUIVALENCE = "data-parallel equivalence"  # every rank vs the one-rank big batch (gates/distributed.py)
    BYTES_PER_STEP = "bytes per step"  # the boundary's traffic independent of N (gates/distributed.py)
    MESH_EQUIVALENCE = "mesh equivalence"  # each dp replica of a dp × pp × tp mesh vs the 1×1×1 big batch (gates/mesh.py)
    # one window on every mesh of one world (gates/mesh.py check_mesh_splits): its own name, not split invariance's,
    # since the two run on different adapters (mesh axes / an ignore_index) and one may be skipped where the other runs
    MESH_SPLIT_INVARIANCE = "mesh split invariance"
    OVERFLOW = "overflow"  # an fp16 window overflowing on one rank (gates/overflow.py)
    PATH_PARITY = "path parity"  # a declared switch (checkpointing, ...) on vs off on the same windows (gates/parity.py)
    REPORTED_METRICS = "reported metrics"  # what metrics() logs vs the harness's own values and the big batch's (gates/metrics.py)
    # Not a claim of its own: reported instead of a numeric gate's failure when two identical runs of the
    # trainer differ (gates/diagnose.py), since no comparison of runs can judge such a trainer.
    DETERMINISM = "determinism"


class GateFailure(AssertionError):
    """A trainer failed a gate; the message names the gate, what differed, where, and the case.

    Structured fields (any may be None) let the plugin, the report, the hints and the self-test read a
    failure without parsing its text: `gate` (a Gate), `case` (the Case), `error` and `bound` (the measured
    quantity and its limit, where the failure is numeric), `hint` (one line: the likely cause)."""

    def __init__(self, message: str = "", *, gate: Gate | str | None = None, case=None, error: float | None = None,
                 bound: float | None = None, hint: str | None = None):
        super().__init__(message)
        # Gate(...) takes a member or its one name and rejects any other spelling (ValueError)
        self.gate = None if gate is None else Gate(gate)
        self.case, self.error, self.bound, self.hint = case, error, bound, hint

    def __reduce__(self):  # crosses process boundaries (pool ranks) with its fields
        return _rebuild_failure, (str(self), self.gate, self.case, self.error, self.bound, self.hint)


def _rebuild_failure(message, gate, case, error, bound, hint) -> GateFailure:
    return GateFailure(message, gate=gate, case=case, error=error, bound=bound, hint=hint)


class GateSkipped(Exception):
    """The gate does not apply to this adapter; str(e) says why."""


class GateResult:
    """A passed gate: which check came closest to its bound, and how close (error / bound). A data-parallel
    run (gate DP_EQUIVALENCE) also carries the collective counter's findings (`extra["comm"]`): one run
    proves both boundary-only and data-parallel equivalence."""

    def __init__(self, gate: Gate, case, worst: str = "", ratio: float = 0.0, **extra):
        self.gate, self.case, self.worst, self.ratio, self.extra = Gate(gate), case, worst, ratio, extra

    def __repr__(self):
        return f"GateResult({self.gate.value!r}, worst={self.worst!r}, ratio={self.ratio:.3g})"


def bare(e: BaseException) -> BaseException:
    """`e` without the frames it was raised through (its traceback, and the exceptions it was raised while handling):
    a gate's frames hold every run it kept, which a failure kept for a report (hypothesis keeps each failing example's)
    would hold on to — at a billion parameters, gigabytes of host memory each."""
    e.__traceback__, e.__context__, e.__cause__, e.__suppress_context__ = None, None, None, True
    return e


def raised_at(e: BaseException) -> str:
    """'FileNotFoundError: ... (mine.py:12)': the exception's first line and the deepest frame outside the
    harness, torch and the standard library (the user's line), else the deepest frame."""
    import os
    import sys
    import traceback

    skip = tuple(os.path.dirname(os.path.abspath(m.__file__)) for m in (sys.modules[__package__.partition(".")[0]], os,
                                                                        sys.modules.get("torch")) if m is not None)
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if not os.path.abspath(f.filename).startswith(skip)] or frames
    text = (str(e).strip().splitlines() or [""])[0]
    where = f" ({os.path.relpath(mine[-1].filename)}:{mine[-1].lineno})" if mine else ""
    return f"{type(e).__name__}{': ' + text if text else ''}{where}"
