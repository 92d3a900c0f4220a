"""The predicted peak beside the measured one: an adapter may declare a memory model,
`verify.MemoryModel(predicted_peak=fn)`, and `python -m verify.memory` reports each configuration's measured peak as a
ratio of it. The harness knows no model: it asks the adapter's hook (`PeakQuery` -> `Prediction`) once,
after the sweeps, on rank 0, and judges only the ratio (exit 1 outside `ABSURD`). xtrain's memory model,
one per data-parallel mode, is xtrain_proof/memory.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ABSURD = (0.25, 4.0)
"""measured/predicted outside this range is not a modelling approximation (a term the size of the whole
peak is missing or double-counted, or the probe measured something else): the run fails."""

PROBES = ("cpu", "cuda")


@dataclass(frozen=True)
class PeakQuery:
    """What a `predicted_peak` hook is asked: predict the peak of these configurations, as `probe` measures it."""

    adapter: Any
    """the verify._internal.protocol.Adapter measured (its `batch` draws rows of its data)"""
    options: Any
    """Spec.options of every configuration"""
    configs: tuple[tuple[int, int], ...]
    """(N, B) per rank: N micro-steps of B rows"""
    world: int
    device: Any
    """torch.device of the run: where the hook may measure what its model needs (e.g. activations)"""
    probe: str
    """'cuda': torch.cuda.max_memory_allocated, every tensor; 'cpu': peak RSS above the RSS right before the
    measured steps, so what exists between steps (parameters, optimizer state, persistent buffers) is in that
    baseline and not counted"""
    trainer_class: str | None
    """the trainer class that ran every configuration (None: mixed or none ran); a model that describes
    one class can decline another"""

    def __post_init__(self):
        if self.probe not in PROBES:
            raise ValueError(f"probe must be one of {', '.join(PROBES)}, got {self.probe!r}")
        if self.world < 1:
            raise ValueError(f"world must be ≥ 1, got {self.world}")


@dataclass(frozen=True)
class Prediction:
    """A hook's answer: the predicted peak bytes per rank of each queried (N, B), with its terms."""

    mode: str
    """the model's name for this trainer (e.g. xtrain's 'fsdp2')"""
    peaks: dict
    """(N, B) -> {'bytes': int, 'terms': {name: bytes}} for every queried configuration"""
    quantity: str
    """what the prediction counts, in words (it must be what the probe measures)"""
    text: str = ""
    """markdown: the model's inputs, for the report"""
    inputs: dict = field(default_factory=dict)
    """the model's inputs, JSON-serializable, for the report"""
    source: str = ""
    """where the model lives (a path or module)"""
    doc: str = ""


def judge(ratio: float | None, predicted: int, floor: int) -> str:
    """'ok', 'absurd', or 'unjudged' (no ratio, or a prediction under 4 × the probe's noise floor)."""
    if ratio is None or predicted < 4 * floor:
        return "unjudged"
    return "ok" if ABSURD[0] <= ratio <= ABSURD[1] else "absurd"


def ask(plan, report: dict) -> Prediction | str:
    """The adapter's prediction for the plan's configurations, or the one-line reason there is none (a
    prediction is reported, so a hook that fails never fails the run)."""
    from verify.memory.probes import one_line

    hook = plan.adapter.predicted_peak
    if hook is None:
        return "no memory model: the adapter declares no predicted_peak (docs/verify-your-trainer.md)"
    ok = [x for c in report["configs"] for x in c["ranks"] if "error" not in x]
    if not ok:
        return "no configuration ran"
    cls = {x.get("trainer_class") for x in ok}
    query = PeakQuery(adapter=plan.adapter, options=plan.options, configs=tuple((c.N, c.B) for c in plan.configs),
                      world=plan.world, device=plan.device, probe="cuda" if plan.cuda else "cpu",
                      trainer_class=cls.pop() if len(cls) == 1 else None)
    try:
        out = hook(query)
    except Exception as e:  # noqa: BLE001
        return f"predicted_peak raised {one_line(e)}"
    if not isinstance(out, (Prediction, str)):
        return f"predicted_peak returned a {type(out).__name__}, not a verify.memory.Prediction or a reason (str)"
    return out


def _fmt(b: int, report: dict) -> str:
    from verify.memory.plan import fmt_bytes, report_unit

    return f"{fmt_bytes(b, report)} {report_unit(report)[0]}"


def add_predictions(report: dict, plan) -> None:
    """Predicted peak per configuration and rank (`predicted_bytes`, `pred_ratio` = measured/predicted in
    every rank row; `predicted_bytes`, `predicted_terms` per configuration) and the `prediction` section:
    mode, inputs, the quantity predicted, verdict (FAIL only for an absurd ratio, see ABSURD)."""
    from verify.memory.invariants import tolerance

    claim = f"measured/predicted within the absurd bounds [{ABSURD[0]}, {ABSURD[1]}] (reported, not judged inside them)"
    for c in report["configs"]:
        c.update(predicted_bytes=None, predicted_terms=None)
        for x in c["ranks"]:
            x.update(predicted_bytes=None, pred_ratio=None)
    pred = ask(plan, report)
    if isinstance(pred, str):
        report["prediction"] = dict(mode=None, verdict="N/A", claim=claim, rows=[pred], reason=pred)
        return
    floor, _ = tolerance(plan.cuda)
    absurd, judged = [], 0
    for c in report["configs"]:
        p = pred.peaks[(c["N"], c["B"])]
        c.update(predicted_bytes=p["bytes"], predicted_terms=p["terms"],
                 pred_ratio=None if c["peak_bytes"] is None else c["peak_bytes"] / p["bytes"])
        for x in c["ranks"]:
            if "error" in x:
                continue
            r = x["peak_bytes"] / p["bytes"] if p["bytes"] > 0 else None
            x.update(predicted_bytes=p["bytes"], pred_ratio=r)
            verdict = judge(r, p["bytes"], floor)
            judged += verdict != "unjudged"
            if verdict == "absurd":
                absurd.append(f"rank {x['rank']}: N={c['N']},B={c['B']} measured {_fmt(x['peak_bytes'], report)} / "
                              f"predicted {_fmt(p['bytes'], report)} = {r:.2f}")
    status = "FAIL" if absurd else "PASS" if judged else "N/A"
    report["prediction"] = dict(
        mode=pred.mode, probe="cuda" if plan.cuda else "cpu", quantity=pred.quantity, verdict=status, claim=claim,
        absurd_bounds=list(ABSURD),
        rows=absurd or ([] if judged else [f"every prediction under 4 × the noise floor ({_fmt(floor, report)})"]),
        text=pred.text, inputs=pred.inputs, model=pred.source, doc=pred.doc)
