"""This repository's GPU CI: `python tools/gpu_gate.py --out DIR` (the options of `python -m verify.gpu_gate`).

It runs the shipped gate (verify.gpu_gate) from the repository root and adds this checkout's own steps:

  gpu-tests   the test suite's GPU tests (tests/ -m gpu)
  nccl-tests  with ≥ 2 GPUs: xtrain's DDP, DDP-option, FSDP2 and planted-bug tests over NCCL

With --trainer (a user's trainer) the repository's steps are left out: they test xtrain's.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NCCL_TESTS = ["tests/harness/test_gates_dist.py", "tests/core/test_fsdp.py", "tests/harness/test_ddp_modes.py"]


def repo_steps(gpus: int, out: str, args, pytest: list, env: dict) -> list:
    """The checkout's steps, as verify.gpu_gate.plan's `extra` hook builds them: (name, command, environment)."""
    from verify import gpu_gate

    if args.trainer:
        return []
    steps = [("gpu-tests", [*pytest, "tests", "-m", "gpu", "--junitxml", os.path.join(out, "gpu-tests.xml")], env)]
    if gpus >= 2:
        command = [*pytest, *NCCL_TESTS, "-m", "distributed", "--verify-backend", "nccl", "--verify-device", "cuda",
                   "-n", "2", "--junitxml", os.path.join(out, "nccl-tests.xml")]
        steps.append(("nccl-tests", command, {**env, **gpu_gate.nccl_world(gpus, args)}))
    return steps


def main(argv=None) -> int:
    sys.path.insert(0, ROOT)  # a bare checkout (no pip install) imports verify and the tests from here
    os.chdir(ROOT)
    from verify import gpu_gate

    return gpu_gate.main(argv, extra=repo_steps)


if __name__ == "__main__":
    sys.exit(main())
