"""The memory plan of a scale run (python -m verify.gpu_gate --scale): before any gate, the GPU memory of the largest
single run (the float64 twin of the largest window: the gates run one trainer at a time) and the host memory of the
Traces a case keeps, from a float64 probe of the trainer itself; a refusal in one line when either cannot fit.
The probe runs micro-steps of 1, 1 and 2 rows, then its optimizer step: the per-row activations are the slope
between the last two peaks (both accumulate into existing gradients), the state what is left after the step plus
the gradients. Design: docs/design/memory.md, "Scale plan".
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from verify._internal.cases.case import TWIN_COPIES
from verify._internal.cases.strategies import SCALE_ACCUM, SCALE_MICRO, SCALE_STEPS
from verify._internal.protocol import Spec

GIB = 2**30
HEADROOM = 0.9  # of the device's memory: the CUDA context, the allocator's fragmentation, the harness's own tensors
HOST_HEADROOM = 0.8  # of the host's memory: the interpreter, torch, the data, the pytest process
MAX_ROWS = TWIN_COPIES[-1] * max(SCALE_ACCUM * SCALE_MICRO, 3 * 2)  # the most rows one run holds (the corners: 3 × 2)
# The most an equivalence case holds on the host at once, in bytes per parameter (the other gates hold less: the
# metrics gate's float64 runs keep no parameters, bit-exact's are fp32): the float64 accumulation and reference, each
# (K + 1) snapshots (the step-0 gradient, the parameters after each of K ≤ SCALE_STEPS steps, 8 bytes); the fp32 pair's
# step-0 gradients (4 bytes each); a twin measured as it runs: its step-0 gradient and the one step in flight.
KEPT_BYTES_PER_PARAMETER = 2 * 8 * (SCALE_STEPS + 1) + 2 * 4 + 2 * 8


@dataclass(frozen=True)
class Plan:
    parameters: int
    state_gib: float  # float64 parameters + gradients + optimizer state, measured
    per_row_gib: float  # float64 activations per row of the trainer's data, measured
    fixed_gib: float  # what a micro-step holds whatever its rows (chunked logits, workspaces)
    rows: int  # the largest run's rows
    need_gib: float
    total_gib: float
    host_need_gib: float = 0.0  # the Traces a case keeps in host memory (KEPT_BYTES_PER_PARAMETER)
    host_total_gib: float = float("inf")

    @property
    def fits(self) -> bool:
        return self.need_gib <= HEADROOM * self.total_gib and self.host_fits

    @property
    def host_fits(self) -> bool:
        return self.host_need_gib <= HOST_HEADROOM * self.host_total_gib

    def largest_rows(self) -> int:
        """The most rows one float64 run can hold at this model size."""
        free = HEADROOM * self.total_gib - self.state_gib - self.fixed_gib
        return max(0, int(free / self.per_row_gib)) if self.per_row_gib > 0 else self.rows

    def largest_parameters(self) -> int:
        """The largest model (scaling state, activations and kept Traces with the parameter count) that fits both."""
        gpu = HEADROOM * self.total_gib / self.need_gib if self.need_gib else 1.0
        host = HOST_HEADROOM * self.host_total_gib / self.host_need_gib if self.host_need_gib else gpu
        return int(self.parameters * min(gpu, host))

    def line(self) -> str:
        return (f"{self.parameters / 1e9:.2f}B parameters: GPU: float64 state {self.state_gib:.1f} GiB + {self.rows} "
                f"rows × {self.per_row_gib * 1024:.0f} MiB + {self.fixed_gib:.1f} GiB = {self.need_gib:.1f} GiB of "
                f"{self.total_gib:.1f} GiB; host: the kept runs {self.host_need_gib:.1f} GiB of "
                f"{self.host_total_gib:.1f} GiB")

    def refusal(self) -> str:
        where = "host memory" if not self.host_fits else "GPU memory"
        return (f"the scale plan does not fit in {where}: {self.line()} (≤ {HEADROOM:.0%} of the GPU, "
                f"{HOST_HEADROOM:.0%} of the host usable); the largest model that fits is "
                f"~{self.largest_parameters() / 1e9:.2f}B parameters"
                + (f", the largest window at this size {self.largest_rows() // TWIN_COPIES[-1]} rows" if self.host_fits
                   else "") + ": prove a smaller size of the same trainer")

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
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Plan(parameters, round(state / GIB, 2), per_row / GIB, round(fixed / GIB, 2), MAX_ROWS,
                round(need / GIB, 1), round(total / GIB, 1), round(KEPT_BYTES_PER_PARAMETER * parameters / GIB, 1),
                round(host / GIB, 1))


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
