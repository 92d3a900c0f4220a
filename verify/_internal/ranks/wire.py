"""What a rank and the harness send each other: pickle bytes, with plain CPU tensors as their raw bytes.

pickle's own route for a tensor saves each storage with torch.save (~0.4 ms per tensor, both ends), and a
gate's reply holds a Trace: every parameter and gradient of every step, hundreds of small tensors. Raw bytes cost
~0.01 ms. Only exact torch.Tensor values on the CPU without autograd go this way (views arrive as copies: a reply
is a snapshot); a Parameter, DTensor, sparse, quantized or CUDA tensor keeps pickle's route.
"""
from __future__ import annotations

import io
import pickle

import torch


def dumps(obj) -> bytes:
    f = io.BytesIO()
    _Pickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return f.getvalue()


def _tensor(raw: bytes, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)  # bytearray: a tensor of its own, writable


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if (type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided
                and not obj.requires_grad and not obj.is_quantized):
            flat = obj.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
            return _tensor, (flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"", obj.dtype,
                             tuple(obj.shape))
        return NotImplemented
