"""FP8 training with torchao (convert_to_float8_training, dynamic tensorwise scaling) and gradient accumulation: a
token-mean LM whose linear layers compute in float8. It has no float64 path, so it declares a native reference
(verify.Numerics(native="fp8")): its gates judge it against its own runs, never a float64 one.

Each forward scales its inputs by their own amax, so a micro-batch is quantized differently from the big batch
(0.9-12.8 % apart in the gradient, reports/cpu/fp8-twins.md) while the accumulation stays exact to its micro-batches:
what the native reference judges (docs/design/tolerance.md, "The native reference"). On a CPU, or a GPU without
FP8 (compute capability < 8.9), torchao emulates the float8 matmuls.

    pip install torchao
    pytest --pyargs verify --verify-trainer examples.fp8_torchao:factory -n auto
"""
import torch
import torch.nn.functional as F

import verify

IGNORE = -100
VOCAB, SEQ_LEN, DIM = 64, 16, 32  # float8 matmuls want every dimension a multiple of 16 (SEQ_LEN: the rows of a matmul)
MAX_NORM = 1.0


class LM(torch.nn.Module):
    """Token embeddings, two residual MLP blocks, a linear head; every Linear is converted to float8."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, 2 * DIM),
                                                              torch.nn.GELU(), torch.nn.Linear(2 * DIM, DIM))
                                          for _ in range(2))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        h = self.tok(ids).flatten(0, 1)  # (rows·S, DIM): the float8 matmuls' rows
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)  # (rows·S, VOCAB)


def fp8_model(spec) -> LM:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(spec.seed)
    model = LM().to(spec.device, spec.dtype)
    cuda = str(spec.device).startswith("cuda")
    real = cuda and torch.cuda.get_device_capability(torch.device(spec.device)) >= (8, 9)  # H100, L4, ...
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=not real))
    return model


class Trainer:
    def __init__(self, spec):
        self.model = fp8_model(spec)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.n = spec.accum_steps
        self.tokens, self.loss_sum = 0, 0.0

    def micro_step(self, x, y, micro):
        # the SUM of the token losses: the window's count is known at the boundary, not before
        loss_sum = F.cross_entropy(self.model(x), y.flatten(), ignore_index=IGNORE, reduction="sum")
        loss_sum.backward()
        self.loss_sum += loss_sum.item()
        self.tokens += int((y != IGNORE).sum())
        if micro == self.n - 1:
            for p in self.model.parameters():
                p.grad /= max(self.tokens, 1)  # ÷ the window's valid tokens, once

    def grads(self):
        return {name: p.grad for name, p in self.model.named_parameters()}

    def optimizer_step(self):
        loss = self.loss_sum / self.tokens if self.tokens else float("nan")
        if self.tokens:  # a window without a valid target takes no step
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=MAX_NORM)
            self.opt.step()
        self.opt.zero_grad()
        self.tokens, self.loss_sum = 0, 0.0
        return loss

    def params(self):
        return dict(self.model.named_parameters())


factory = verify.adapter(data=verify.data.tokens(vocab=VOCAB, seq_len=SEQ_LEN),
                         batches=verify.Batches(ignore_index=IGNORE),
                         numerics=verify.Numerics(native="fp8"))(Trainer)
