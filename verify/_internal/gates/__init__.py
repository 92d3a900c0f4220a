"""The gates: single-process (equivalence, bit-exact), data-parallel (boundary-only communication,
equivalence across ranks), the token-mean claim and empty windows (tokens.py), judged by ONE tolerance
policy (tolerance.py)."""
from verify._internal.gates.distributed import (check_boundary_only, check_dist_equivalence, check_distributed, check_same_bytes, run_distributed)
from verify._internal.gates.overflow import check_overflow
from verify._internal.verdict import Gate, GateFailure, GateResult, GateSkipped
from verify._internal.gates.single import check_bit_exact, check_equivalence
from verify._internal.gates.objective import check_normaliser
from verify._internal.gates.tokens import check_empty_window

__all__ = ["check_equivalence", "check_bit_exact", "check_distributed", "check_same_bytes", "check_boundary_only",
           "check_dist_equivalence", "run_distributed", "Gate", "GateResult", "GateSkipped", "GateFailure",
           "check_normaliser", "check_empty_window", "check_overflow"]
