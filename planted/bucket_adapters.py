"""examples/ddp_no_sync.py with a per-bucket DDP communication hook that averages only the FIRST bucket (the others
are summed over the ranks: W times too large). A model of one bucket, every toy case's, is right; only past the
recipe's declared bucket-cap threshold (several buckets) does the data-parallel gate see it."""
import dataclasses

import torch.distributed as dist

from examples import ddp_no_sync


def first_bucket_mean(group, bucket):
    t = bucket.buffer()
    if bucket.index() == 0:  # BUG: every bucket must be divided by the world, not only the first
        t.div_(dist.get_world_size(group))
    return dist.all_reduce(t, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


class FirstBucketMean(ddp_no_sync.Trainer):
    def __init__(self, spec):
        super().__init__(spec)
        self.ddp.register_comm_hook(self.ddp.process_group, first_bucket_mean)


first_bucket_only = dataclasses.replace(ddp_no_sync.factory, factory=FirstBucketMean, ref=None,
                                        name="broken: DDP comm hook averaging only the first bucket")
