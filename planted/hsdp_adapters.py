"""HSDP-style data parallelism: reduce within the node on every micro-step, across nodes only at the boundary.

Ranks are numbered node by node (LOCAL_WORLD_SIZE ranks a node, as torchrun does; a pool emulates nodes with
XTRAIN_RANKS_PER_NODE). Each micro-step's gradient (and loss) is all-reduced within the node, one group per
node, and summed into an accumulator; at the boundary the accumulator is all-reduced across nodes, one group
per local rank, then ÷ N·W. Numerically the global batch mean, like any data-parallel trainer; what makes it
HSDP is where the traffic goes, and its count table row says so per link:

    before the boundary     all_reduce@intra-node × 1
    at the boundary         all_reduce@intra-node × 1, all_reduce@inter-node × 1

    hsdp          the above: passes boundary-only and data-parallel equivalence
    eager_inter   planted: also all-reduces across nodes on every micro-step (the numbers are the same:
                  the accumulator is then the global sum already, so the boundary's cross-node reduction
                  carries the last micro-step only); only the count, by link, rejects it
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import verify
import verify.study

VOCAB = 11


def groups(world: int, rank: int, per_node: int):
    """(this rank's node group, this rank's cross-node group); None for a group of one rank (nothing to reduce).
    Every rank creates every group, in the same order (torch.distributed.new_group's rule)."""
    nodes = -(-world // per_node)
    node_of = [list(range(n * per_node, min(world, (n + 1) * per_node))) for n in range(nodes)]
    across = [list(range(i, world, per_node)) for i in range(per_node)]
    mine = {}
    for kind, lists in (("intra", node_of), ("inter", across)):
        for ranks in lists:
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = g if len(ranks) > 1 else None
    return mine["intra"], mine["inter"]


class HSDP:
    eager_inter = False

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Tanh(), torch.nn.Linear(8, VOCAB))
        self.model = net.to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.n = spec.accum_steps
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.intra = self.inter = None
        if self.world > 1:
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or self.world)
            self.intra, self.inter = groups(self.world, dist.get_rank(), per_node)
        self.acc = None

    def micro_step(self, x, y, micro):
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        loss.backward()
        ps = list(self.model.parameters())
        flat = torch.cat([p.grad.flatten() for p in ps] + [loss.detach().reshape(1)])
        self.model.zero_grad(set_to_none=False)
        if self.intra is not None:
            dist.all_reduce(flat, group=self.intra)  # within the node: every micro-step
        if self.inter is not None and self.eager_inter:
            dist.all_reduce(flat, group=self.inter)  # planted: across nodes too, every micro-step
        self.acc = flat if self.acc is None else self.acc + flat
        if micro == self.n - 1:  # the boundary: across nodes, once
            if self.inter is not None and not self.eager_inter:
                dist.all_reduce(self.acc, group=self.inter)
            self.acc /= self.n * self.world
            torch.nn.utils.vector_to_parameters(self.acc[:-1], [p.grad for p in ps])

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        loss, self.acc = self.acc[-1].clone(), None
        return loss

    def params(self):
        return dict(self.model.named_parameters())


class EagerInter(HSDP):
    eager_inter = True


def row(case):
    """HSDP's count table row: per link (a node of one rank has no intra-node reduction, one node no
    inter-node one; the layout is the pool's, XTRAIN_RANKS_PER_NODE)."""
    per_node = verify.study.current_settings().per_node(case.world)  # the Settings the pool runs under
    intra, inter = int(per_node > 1), int(case.world > per_node)
    return verify.CountRow("HSDP: inter-node at the boundary only", before={"all_reduce@intra-node": intra},
                           boundary={"all_reduce@intra-node": intra, "all_reduce@inter-node": inter})


_common = dict(data=verify.data.tokens(vocab=VOCAB, seq_len=5), data_parallel=True, counts=row)
hsdp = verify.adapter(**_common)(HSDP)
eager_inter = verify.adapter(**_common)(EagerInter)
