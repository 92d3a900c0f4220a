"""A trainer whose bug the gates' hard corners (N=3) do not show, so only a random draw finds it and hypothesis
saves the shrunk failure in its example database (explicit examples are never saved): the 1/N is missing at
N = 2 only (tests/harness/test_report_keys.py)."""
import verify
from examples.mlp_regressor import Trainer


class MissingHalfAtTwo(Trainer):
    def micro_step(self, x, y, micro):
        n, self.n = self.n, (1 if self.n == 2 else self.n)  # N = 2: the raw loss, no 1/N
        try:
            super().micro_step(x, y, micro)
        finally:
            self.n = n


adapter = verify.adapter(data=verify.data.regression(features=8))(MissingHalfAtTwo)
