"""Load-balancing bugs of examples/moe_aux.py's trainer (a global-batch aux term, declared `batch`), one change
each, that the gates must reject naming the term 'aux' (and the factor where there is one):

    aux_over_world           the window's aux ÷ W (Megatron #3672): right at W=1, ×1/W at W=2
    aux_over_n_twice         aux ÷ N on top of its window normaliser: ×1/N
    counts_reset_per_micro   the expert counts reset every micro-step (ms-swift #6787): the micro-batch loss
    counts_in_recompute      the MoE layer tallies its routing in forward, and torch.utils.checkpoint's recompute
                             tallies again (NeMo Automodel PR #3247): every recomputed micro-step counted again

counts_in_recompute shows only because the count read at the last micro-step (after its forward, before its
backward) holds the recomputations of micro-steps 0..N-2 and none of its own: at N=1 it is right. A trainer that
read the tally only after every backward would be off by the same factor at every N, the big batch included,
and no equivalence gate could see it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import verify
from examples import moe_aux


class AuxOverWorld(moe_aux.Trainer):
    def balance_weights(self, counts, positions):  # the global counts' aux, then ÷ W as if it were a per-rank mean
        return super().balance_weights(counts, positions) / (dist.get_world_size() if dist.is_initialized() else 1)


class AuxOverNTwice(moe_aux.Trainer):
    def balance_weights(self, counts, positions):  # the accumulation's 1/N applied to a term that needs none
        return super().balance_weights(counts, positions) / self.n


class CountsResetPerMicro(moe_aux.Trainer):
    MODE = "micro"  # each micro-batch's own counts, averaged over the micro-steps: declared global all the same


class CountingMoE(moe_aux.MoE):
    """The MoE layer keeping a tokens-per-expert tally, advanced in its forward (a recompute runs it again)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("load", torch.zeros(moe_aux.EXPERTS, dtype=torch.int64), persistent=False)

    def route(self, h):  # tallied where it routes, before the experts run (a recompute gets this far)
        probs, chosen, gates = super().route(h)
        self.load += torch.bincount(chosen.flatten(), minlength=moe_aux.EXPERTS)
        return probs, chosen, gates


class CountingLM(moe_aux.LM):
    def __init__(self, checkpointing=False):
        super().__init__(checkpointing)
        self.moe = CountingMoE()


class CountsInRecompute(moe_aux.Trainer):
    MODEL = CountingLM

    def __init__(self, spec):
        super().__init__(spec)
        self.read = torch.zeros(moe_aux.EXPERTS, dtype=torch.int64)

    def expert_counts(self, chosen):  # the layer's tally since the last read, not this forward's routing
        load = self.model.moe.load.cpu().clone()
        new, self.read = load - self.read, load
        return new


def _declare(cls):
    return verify.adapter(data=moe_aux.data, ignore_index=moe_aux.IGNORE, objective=moe_aux.OBJECTIVE,
                          options=moe_aux.OPTIONS, defaults=moe_aux.Options(), data_parallel=True,
                          name=f"broken MoE {cls.__name__}")(cls)


aux_over_world = _declare(AuxOverWorld)
aux_over_n_twice = _declare(AuxOverNTwice)
counts_reset_per_micro = _declare(CountsResetPerMicro)
counts_in_recompute = _declare(CountsInRecompute)
