"""A correct fp16-autocast MLP whose head-bias gradient cancels across micro-batches (tests/harness/
test_cancellation.py): its targets are +A on the first half of a step's rows and −A on the second, so each
micro-batch pulls the head bias hard one way and the whole window barely at all (κ of the bias ≈ 10–1000).
Each micro-batch's share leaves the autocast kernel rounded to fp16 before the fp32 add: legitimately less
exact than the big batch's one rounding of the sum, by up to u16·κ (verify/_internal/gates/tolerance.py, F_p)."""
import torch
import torch.nn.functional as F

import verify
from planted.template import ModelState

FEATURES, A = 8, 30.0


def _data(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=g)
    sign = torch.where(torch.arange(rows) < rows // 2, 1.0, -1.0) if rows > 1 else torch.ones(1)
    y = (A * sign + 0.1 * torch.randn(rows, generator=g)).unsqueeze(1)
    return x, y


class CancellingBias(ModelState):
    """N micro-steps of backward(loss / N) under autocast, SGD at the boundary: the textbook loop."""

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(),
                                         torch.nn.Linear(16, 1)).to(spec.device, spec.dtype)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.n, self.spec, self.losses = spec.accum_steps, spec, []
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.precision)

    def micro_step(self, x, y, micro):
        with torch.autocast(x.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
            loss = F.mse_loss(self.model(x).float(), y)
        (loss if self.n == 1 else loss / self.n).backward()
        self.losses.append(loss.detach().double())

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss, self.losses = torch.stack(self.losses).mean(), []
        return loss


cancelling_bias = verify.adapter(data=_data, precisions=("fp32", "bf16", "fp16"))(CancellingBias)
