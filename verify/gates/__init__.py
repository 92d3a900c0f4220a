"""The gates: single-process (equivalence, bit-exact) and data-parallel (boundary-only communication,
equivalence across ranks), judged by ONE tolerance policy (tolerance.py)."""
from .distributed import (check_boundary_only, check_dist_equivalence, check_distributed, check_same_bytes,
                          run_distributed)
from .single import GateResult, GateSkipped, check_bit_exact, check_equivalence
from .tolerance import GateFailure

__all__ = ["check_equivalence", "check_bit_exact", "check_distributed", "check_same_bytes", "check_boundary_only",
           "check_dist_equivalence", "run_distributed", "GateResult", "GateSkipped", "GateFailure"]
