"""dp × pp: data-parallel replicas of examples/pipeline_schedule.py's pipeline. Each replica's stages see its
rows (the harness shards them over dp only); at micro-step N-1 each stage averages its gradients (and the last
stage its loss) over its dp group — the ranks holding the same stage in the other replicas — once: the dp
axis stays boundary-only, the pp traffic runs on every schedule step.

    XTRAIN_DIST_MAX_WORLD=4 pytest --pyargs verify --verify-trainer examples.pipeline_dp:factory -n auto
"""
import torch.distributed as dist

import verify
from examples import pipeline_schedule


class Trainer(pipeline_schedule.Trainer):
    def __init__(self, spec):
        super().__init__(spec)
        self.dp_group = None
        if spec.mesh.dp > 1:
            self.dp_group = verify.device_mesh(spec)["dp"].get_group()

    def micro_step(self, x, y, micro):
        super().micro_step(x, y, micro)
        if micro == self.n - 1 and self.dp_group is not None:
            self.average_over_dp()

    def average_over_dp(self):
        """The boundary: this stage's gradients and loss, the dp group's mean, reduced once."""
        replicas = self.dp_group.size()
        for t in [*self.grads().values(), self.loss]:
            t.div_(replicas)
            dist.all_reduce(t, group=self.dp_group)


# the pipeline recipe's data, schedule options and metrics, on a dp × pp mesh
factory = verify.adapter(data=pipeline_schedule.factory.data, distributed=verify.Distributed(mesh_axes=("dp", "pp")),
                         defaults=pipeline_schedule.factory.defaults,
                         options=pipeline_schedule.factory.options,
                         metrics=pipeline_schedule.factory.metrics)(Trainer)
