"""An adapter the self-test must flag: its trainer reports no loss (always 0), so a fault that only
changes the reported loss (loss_sum_not_mean) cannot be seen by any gate and survives."""
import torch

import verify
from examples.mlp_regressor import Plain, Trainer


class Silent(Trainer):
    def optimizer_step(self):
        super().optimizer_step()
        return torch.zeros(())


class SilentPlain(Plain):
    def optimizer_step(self):
        super().optimizer_step()
        return torch.zeros(())


adapter = verify.adapter(data=verify.data.regression(features=8), plain=SilentPlain)(Silent)
