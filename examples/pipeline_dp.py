"""dp × pp: data-parallel replicas of examples/pipeline_schedule.py's pipeline. Each replica's stages see its
rows (the harness shards them over dp only); at micro-step N-1 each stage averages its gradients (and the last
stage its loss) over its dp group — the ranks holding the same stage in the other replicas — once: the dp
axis stays boundary-only, the pp traffic runs on every schedule step.

    XTRAIN_DIST_MAX_WORLD=4 pytest --pyargs verify --verify-trainer examples.pipeline_dp:factory -n auto
"""
import torch

import verify
from examples import pipeline_schedule


class Trainer(pipeline_schedule.Trainer):
    def __init__(self, spec):
        super().__init__(spec)
        self.dp = verify.mesh.device_mesh(spec)["dp"].get_group() if spec.mesh.dp > 1 else None

    def micro_step(self, x, y, micro):
        super().micro_step(x, y, micro)
        for t in [*self.grads().values(), self.loss] if micro == self.n - 1 and self.dp else ():
            torch.distributed.all_reduce(t.div_(self.dp.size()), group=self.dp)  # the boundary: dp's mean, once


factory = verify.adapter(data=pipeline_schedule.factory.data, mesh_axes=("dp", "pp"), defaults=pipeline_schedule.factory.defaults,
                         options=pipeline_schedule.factory.options)(Trainer)
