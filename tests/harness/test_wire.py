"""verify/_internal/ranks/wire.py: what ranks and the harness send each other comes back equal, in dtype, shape and
every bit, as a tensor of its own; what it does not carry as raw bytes keeps pickle's route."""
import pickle

import torch

from verify._internal.ranks import wire


def test_tensors_come_back_bit_for_bit_as_tensors_of_their_own():
    base = torch.randn(4, 6, dtype=torch.float64)
    sent = {"f64": base, "bf16": base.to(torch.bfloat16), "f16": base.half(), "bool": base > 0,
            "int": torch.arange(5), "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3),
            "view": base.t()[1:3], "conj": torch.randn(3, dtype=torch.complex64).conj(),
            "nan": torch.tensor([float("nan"), -0.0, float("inf")]), "nested": [(base[0], "x")]}
    got = pickle.loads(wire.dumps(sent))
    bits = lambda t: t.resolve_conj().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731  (-0.0, NaN: every bit)
    for k, t in sent.items():
        if k != "nested":
            g = got[k]
            assert type(g) is torch.Tensor and g.dtype == t.dtype and g.shape == t.shape, k
            assert torch.equal(bits(g), bits(t)), k
    assert torch.equal(got["nested"][0][0], base[0]) and got["nested"][0][1] == "x"
    got["f64"].add_(1.0)  # writable, and not the sender's memory
    assert not torch.equal(got["f64"], base)


def test_what_is_not_a_plain_cpu_tensor_keeps_picklings_route():
    p = torch.nn.Parameter(torch.ones(3))
    leaf = torch.ones(2, requires_grad=True)
    got = pickle.loads(wire.dumps({"p": p, "leaf": leaf}))
    assert type(got["p"]) is torch.nn.Parameter and got["p"].requires_grad and torch.equal(got["p"], p)
    assert got["leaf"].requires_grad and torch.equal(got["leaf"].detach(), leaf.detach())
