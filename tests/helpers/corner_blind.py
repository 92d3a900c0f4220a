"""A trainer whose bug the gates' hard corners (N=3) do not show, so only a random draw finds it and hypothesis
saves the shrunk failure in its example database (explicit examples are never saved): the 1/N is missing at
every N but the corners' N = 3, so any random draw with N ∉ {1, 3} shows it (tests/harness/test_report_keys.py)."""
import verify
from examples.mlp_regressor import Trainer


class MissingScaleOffCorner(Trainer):
    def micro_step(self, x, y, micro):
        n, self.n = self.n, (self.n if self.n == 3 else 1)  # N ≠ 3: the raw loss, no 1/N
        try:
            super().micro_step(x, y, micro)
        finally:
            self.n = n


adapter = verify.adapter(data=verify.data.regression(features=8))(MissingScaleOffCorner)
