"""A planted bug in the torchtitan recipe (tests/examples/test_torchtitan_recipe.py): its boundary gradient × N, the
1/N scale missing. Imported only where torchtitan is installed (the [torchtitan] extra)."""
from examples import torchtitan_train as tt


class _GradsTimesN(tt.Adapter):
    def grads(self):
        n = self.titan.gradient_accumulation_steps
        return {k: v * n for k, v in super().grads().items()}


grads_times_n = tt.factory.replace(factory=_GradsTimesN)
