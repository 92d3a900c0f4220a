"""An adapter whose trainer raises at N ≥ 3 (a bug in the user's own code, not an accumulation error): the
plugin shows the user's frame, hides the harness's, and prints the error's line whole in the summary."""
import verify
from examples.mlp_regressor import Plain, Trainer


class Raising(Trainer):
    def micro_step(self, x, y, micro):
        if self.n >= 3:
            raise RuntimeError(f"this trainer cannot take accum_steps={self.n}: a bug in the user's own micro_step")
        return super().micro_step(x, y, micro)


adapter = verify.adapter(data=verify.data.regression(features=8), plain=Plain)(Raising)
