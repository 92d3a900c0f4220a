"""The context-parallel axis's count bugs, on examples/context_parallel.py (a token mean over dp × cp):

    count_over_dp_only     the valid-target count reduced over dp only: each cp rank divides by its own tokens' count,
                           under by about cp, and the cp ranks disagree (verl PR #5993)
    count_of_whole_rows    each cp rank counts its rows' valid targets whole (its rows are every cp rank's), then the
                           count is reduced over dp × cp: over by exactly cp (prime-rl PR #2562's proposal)
    loss_times_cp          a leftover × cp_size on the reduced gradient: cp× (Megatron #673)
    local_mean_nan         each cp rank's own token mean, averaged over cp: a cp rank without a valid target gives
                           0/0 = NaN (mcore-bridge PR #104)
    cp_rank_token_mean     the same, guarded (÷ max(count, 1)), the replicas then weighted right: exact on unpadded
                           rows, wrong wherever padding makes the cp ranks' counts differ — a right-padded row's
                           padding lands on the LAST cp rank, so the common case (issue 42 item 4)
    dp_replica_token_mean  the count right over cp, but each dp replica's own token mean averaged over dp: exact
                           unless one replica holds fewer valid targets (an empty micro-batch on one replica)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from examples import context_parallel as cp

IGNORE = cp.IGNORE


class CountOverDpOnly(cp.Trainer):
    def reduce(self):
        count = torch.tensor(float(self.count))
        if self.dp_group is not None:
            dist.all_reduce(count, group=self.dp_group)
        super().reduce()  # the sums as the recipe reduces them, then the count it should not have
        ratio = self.global_count / count.item() if count.item() else float("nan")
        for p in self.model.parameters():
            p.grad.mul_(ratio)
        self.loss = self.loss * ratio

    def scale(self, flat):
        self.global_count = flat[-1].item()


class CountOfWholeRows(cp.Trainer):
    def counted(self, y):
        if self.cp_group is None:
            return super().counted(y)
        parts = [torch.empty_like(y) for _ in range(self.cp)]
        dist.all_gather(parts, y.contiguous(), group=self.cp_group)
        return int((torch.cat(parts, dim=1) != IGNORE).sum())  # the whole rows: every cp rank counts them all


class LossTimesCp(cp.Trainer):
    def scale(self, flat):
        flat[:-1].mul_(self.cp)  # the gradient and the loss sum


class LocalMeanNan(cp.Trainer):
    def reduce(self):
        """Each cp rank divides its own sums by its own count (0/0 where it holds no valid target), then the cp
        ranks' means are averaged, and the dp replicas' summed as the recipe does."""
        params = list(self.model.parameters())
        local = torch.tensor(float(self.count), dtype=params[0].dtype)
        flat = torch.cat([p.grad.flatten() for p in params] + [torch.tensor([self.total], dtype=params[0].dtype)])
        flat = flat / local  # NaN on a cp rank whose tokens are all padding
        if self.cp_group is not None:
            dist.all_reduce(flat, group=self.cp_group)
            flat = flat / self.cp
        if self.dp_group is not None:
            dist.all_reduce(flat, group=self.dp_group)
            flat = flat / dist.get_world_size(self.dp_group)
        self.loss = flat[-1].item()
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def whole_rows_counts(case):
    """The recipe's row, and the labels' all-gather this trainer declares per micro-step (its traffic is not the bug)."""
    rows = cp.counts(case)
    if "cp" in rows:
        r = rows["cp"]
        rows["cp"] = cp.verify.CountRow(r.mode + ", + the labels gathered", before={**r.before, "all_gather": 3},
                                        boundary={**r.boundary, "all_gather": 3})
    return rows


def _declare(cls, counts=cp.counts):
    return cp.verify.adapter(data=cp.data, ignore_index=IGNORE, mesh_axes=("dp", "cp"),
                             mesh_sizes={"cp": (2, 4, 8)}, counts=counts, name=f"broken cp {cls.__name__}")(cls)


count_over_dp_only = _declare(CountOverDpOnly)
count_of_whole_rows = _declare(CountOfWholeRows, whole_rows_counts)
loss_times_cp = _declare(LossTimesCp)
local_mean_nan = _declare(LocalMeanNan)


class CpRankTokenMean(cp.Trainer):
    def reduce(self):
        """Each cp rank's own mean (÷ its own count, at least 1), averaged over cp; then each replica weighted by its
        count over dp (right), in the recipe's collectives: one all-reduce over cp, one over dp."""
        params = list(self.model.parameters())
        dt = params[0].dtype
        flat = torch.cat([p.grad.flatten() for p in params] + [torch.tensor([self.total], dtype=dt)])
        flat = torch.cat([flat / max(self.count, 1), torch.tensor([float(self.count)], dtype=dt)])
        if self.cp_group is not None:  # Σ over cp of the ranks' means, and the replica's count
            dist.all_reduce(flat, group=self.cp_group)
            flat[:-1] /= self.cp
        if self.dp_group is not None:  # the replicas' means weighted by their counts: right over dp
            flat[:-1] *= flat[-1]
            dist.all_reduce(flat, group=self.dp_group)
            flat[:-1] /= flat[-1] if flat[-1] else 1.0
        self._set(params, flat)

    def _set(self, params, flat):
        count = flat[-1].item()
        self.loss, self.window_count = (flat[-2].item() if count else float("nan")), count
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


class DpReplicaTokenMean(CpRankTokenMean):
    def reduce(self):
        """The count reduced over cp with the sums (right), then each replica's own mean averaged over dp."""
        params = list(self.model.parameters())
        dt = params[0].dtype
        flat = torch.cat([p.grad.flatten() for p in params] + [torch.tensor([self.total, float(self.count)], dtype=dt)])
        if self.cp_group is not None:
            dist.all_reduce(flat, group=self.cp_group)
        flat[:-1] /= flat[-1] if flat[-1] else 1.0  # the replica's own token mean
        if self.dp_group is not None:  # averaged over the replicas, each weighing 1/dp whatever it holds
            dist.all_reduce(flat, group=self.dp_group)
            flat[:-1] /= dist.get_world_size(self.dp_group)
        self._set(params, flat)


cp_rank_token_mean = _declare(CpRankTokenMean)
dp_replica_token_mean = _declare(DpReplicaTokenMean)
