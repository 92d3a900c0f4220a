"""A correct dp × tp trainer (planted/broken_mesh.py's Tp) whose dp reductions the self-test's
interposition cannot reach: it calls all_reduce through a name bound at import, as it cannot reach DDP's C++
Reducer either. dp_reduction_skipped and reduced_over_wrong_group change nothing here and must SURVIVE: the
self-test does not count a kill it did not see."""
import torch
from torch.distributed import all_reduce  # bound before the self-test's interposition: out of its reach

import verify
from planted import broken_mesh


class Bound(broken_mesh.Tp):
    def _reduce(self, tensors):
        for t in tensors:
            all_reduce(t, group=self.group)
            t /= self.m.dp

    def micro_step(self, x, y, micro):
        self.group, self.dp_group = self.dp_group, None  # Tp's own dp reduction off: ours below
        super().micro_step(x, y, micro)
        self.dp_group = self.group
        if micro == self.N - 1 and self.group is not None:
            self._reduce([p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in self.model.parameters()])

    def optimizer_step(self):
        self.dp_group = None
        loss = super().optimizer_step()
        self.dp_group = self.group
        if self.group is not None:
            t = torch.tensor([loss], dtype=torch.float64)
            self._reduce([t])
            loss = float(t)
        return loss


adapter = verify.adapter(data=broken_mesh.DATA, mesh_axes=("dp", "tp"), counts=broken_mesh.tp_counts,
                         name="mesh_tp_bound")(Bound)
