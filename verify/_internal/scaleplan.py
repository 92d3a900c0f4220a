"""The memory plan of a scale run (python -m verify.gpu_gate --scale): before any gate, what the largest run a gate
makes will hold on the GPU, from a probe of the trainer itself, and a refusal in one line when it cannot fit.

The gates run one trainer at a time (every Trace is a CPU copy; Adapter.__call__ frees the last trainer's cycles on
CUDA), so the peak is the largest single run: the float64 reference on the most rows any run of the scale profile
holds (the equivalence gate's twin: TWIN_COPIES[-1] copies of the largest window, N·B = MAX_ACCUM·MAX_MICRO rows).
An fp32 or bf16 run holds at most half of a float64 one. The probe builds the trainer in float64 at its defaults and
runs micro-steps of 1, 1 and 2 rows, then its optimizer step: the per-row activations are the slope between the last
two peaks (both accumulating into existing gradients: the first micro-step's backward takes its gradients without
an add), the state (parameters, gradients, optimizer) what is left after the step plus the gradients.
Design: docs/design/memory.md, "Scale plan".
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from verify._internal.cases.case import TWIN_COPIES
from verify._internal.cases.strategies import MAX_ACCUM, MAX_MICRO
from verify._internal.protocol import Spec

GIB = 2**30
HEADROOM = 0.9  # of the device's memory: the CUDA context, the allocator's fragmentation, the harness's own tensors
MAX_ROWS = TWIN_COPIES[-1] * MAX_ACCUM * MAX_MICRO  # the most rows one run of a gate holds


@dataclass(frozen=True)
class Plan:
    parameters: int
    state_gib: float  # float64 parameters + gradients + optimizer state, measured
    per_row_gib: float  # float64 activations per row of the trainer's data, measured
    fixed_gib: float  # what a micro-step holds whatever its rows (chunked logits, workspaces)
    rows: int  # the largest run's rows
    need_gib: float
    total_gib: float

    @property
    def fits(self) -> bool:
        return self.need_gib <= HEADROOM * self.total_gib

    def largest_rows(self) -> int:
        """The most rows one float64 run can hold at this model size."""
        free = HEADROOM * self.total_gib - self.state_gib - self.fixed_gib
        return max(0, int(free / self.per_row_gib)) if self.per_row_gib > 0 else self.rows

    def largest_parameters(self) -> int:
        """The largest model (scaling state and activations with the parameter count) whose largest run fits."""
        scale = HEADROOM * self.total_gib / self.need_gib if self.need_gib else 1.0
        return int(self.parameters * scale)

    def line(self) -> str:
        return (f"{self.parameters / 1e9:.2f}B parameters: float64 state {self.state_gib:.1f} GiB + {self.rows} rows × "
                f"{self.per_row_gib * 1024:.0f} MiB + {self.fixed_gib:.1f} GiB = {self.need_gib:.1f} GiB of "
                f"{self.total_gib:.1f} GiB")

    def refusal(self) -> str:
        return (f"the scale plan does not fit: {self.line()} (≤ {HEADROOM:.0%} usable); the largest model that fits "
                f"at this window is ~{self.largest_parameters() / 1e9:.2f}B parameters, the largest window at this "
                f"size {self.largest_rows()} rows per run ({self.largest_rows() // TWIN_COPIES[-1]} per window): "
                f"declare a smaller size, or activation checkpointing")

    def as_dict(self) -> dict:
        return {**asdict(self), "fits": self.fits, "largest_rows": self.largest_rows(),
                "largest_parameters": self.largest_parameters()}


def probe(adapter, device: str) -> Plan:
    """Measure the trainer at its defaults in float64 on `device` (a CUDA device) and plan the largest run."""
    dev = torch.device(device)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    trainer = adapter(Spec(accum_steps=3, dtype=torch.float64, device=device, options=adapter.defaults))
    params = trainer.params()
    parameters = sum(p.numel() for p in params.values())
    weights = torch.cuda.memory_allocated(dev) - base
    peaks = []
    for m, rows in enumerate((1, 1, 2)):
        x, y = adapter.batch(rows, seed=m, options=adapter.defaults)
        torch.cuda.reset_peak_memory_stats(dev)
        trainer.micro_step(x.to(device, torch.float64 if x.is_floating_point() else x.dtype), y.to(device), m)
        peaks.append(torch.cuda.max_memory_allocated(dev) - base)
    grads = sum(g.numel() * g.element_size() for g in trainer.grads().values() if g is not None)
    trainer.optimizer_step()
    state = torch.cuda.memory_allocated(dev) - base + grads  # after zero_grad(set_to_none): + the gradients again
    per_row = max(0, peaks[2] - peaks[1])
    fixed = max(0, peaks[1] - per_row - weights - grads)
    del trainer, params
    need = state + fixed + MAX_ROWS * per_row
    total = torch.cuda.get_device_properties(dev).total_memory
    return Plan(parameters, round(state / GIB, 2), per_row / GIB, round(fixed / GIB, 2), MAX_ROWS,
                round(need / GIB, 1), round(total / GIB, 1))


def main(argv=None) -> int:
    """python -m verify._internal.scaleplan MODULE:FACTORY DEVICE OUT.json: the plan, one line; exit 2 when it cannot
    fit (the refusal, one line), nothing written then. verify.gpu_gate --scale runs it as its first step."""
    import json
    import sys

    from verify._internal.cli import fail
    from verify._internal.header import atomic_write, header
    from verify._internal.protocol import AdapterError, load_adapter

    from verify._internal.cli import PROG

    PROG[0] = "verify.scaleplan"
    ref, device, out = (argv if argv is not None else sys.argv[1:])[:3]
    try:
        adapter = load_adapter(ref, option="--trainer")
    except AdapterError as e:
        fail(str(e))
    plan = probe(adapter, device)
    if not plan.fits:
        fail(plan.refusal())
    atomic_write(out, json.dumps({**header("scale-plan", "cuda"), "trainer": ref, "plan": plan.as_dict()}, indent=1))
    print(f"verify scale plan: {plan.line()}: fits")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
