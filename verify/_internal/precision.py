"""The precisions a trainer may declare and a case runs in, and the autocast dtype of each low one (re-exported by
verify._internal.protocol, where the adapter's `precisions` and the Spec's `precision` use them)."""
from __future__ import annotations

from enum import StrEnum

import torch

__all__ = ["Precision", "AUTOCAST"]


class Precision(StrEnum):
    """The precisions a trainer may support (Adapter.precisions) and a case runs in (Case.precision, Spec.precision):
    fp32, or autocast to bf16 / fp16 over parameters in the run's dtype. A member equals its string."""
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    def __repr__(self) -> str:  # a case prints as it is written: Case(..., precision='fp16')
        return repr(self.value)


AUTOCAST = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}
"""The autocast dtype of each low precision."""
