"""A small mixture-of-experts language model (a top-2 router over 4 experts) trained on cross-entropy plus a
Switch/Mixtral load-balancing term, aux = E · Σ_e f_e · P_e, counted over the whole optimizer window (every
micro-step, every rank: the Qwen global-batch balancing), with AdamW and a manual all-reduce at the boundary.

    pytest --pyargs verify --verify-trainer examples.moe_aux:factory
    python -m verify.selftest --verify-trainer examples.moe_aux:factory
    XTRAIN_DIST_MIN_WORLD=2 XTRAIN_DIST_MAX_WORLD=2 pytest --pyargs verify --verify-trainer examples.moe_aux:factory -n 2
    pytest --pyargs verify --verify-trainer examples.moe_aux:per_micro     # aux per micro-batch: a declared difference
"""
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

import verify

IGNORE = -100
VOCAB, SEQ, WIDTH, HIDDEN = 16, 6, 8, 16
EXPERTS, TOP_K = 4, 2
AUX_WEIGHT = 0.1  # the load-balancing coefficient (Switch uses 0.01; larger here so a wrong factor shows)


@dataclass(frozen=True)
class Options:
    checkpointing: bool = False  # recompute the MoE layer in the backward (torch.utils.checkpoint)


class MoE(torch.nn.Module):
    """A router and EXPERTS small MLPs; each token goes to its TOP_K most probable experts (Mixtral: the
    chosen probabilities renormalised). Every expert runs on every token, weighted 0 where not chosen:
    dense, but the routing (and so the gradient) is the sparse layer's."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, WIDTH))
            for _ in range(EXPERTS))

    def route(self, h):
        """h -> the router's probabilities (rows, S, E), the chosen experts (rows, S, K), each expert's gate."""
        probs = self.router(h).softmax(dim=-1)
        top_p, chosen = probs.topk(TOP_K, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, chosen, top_p / top_p.sum(dim=-1, keepdim=True))
        return probs, chosen, gates

    def forward(self, h):
        """h (rows, S, WIDTH) -> h + the chosen experts' mix, the router's probabilities (rows, S, E), the
        chosen experts (rows, S, K)."""
        probs, chosen, gates = self.route(h)
        mixed = sum(gates[..., e:e + 1] * expert(h) for e, expert in enumerate(self.experts))
        return h + mixed, probs, chosen


class LM(torch.nn.Module):
    """Embedding -> one MoE layer (optionally recomputed in the backward) -> a linear head."""

    def __init__(self, checkpointing=False):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.moe = MoE()
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.checkpointing = checkpointing

    def forward(self, x):
        h = self.embed(x)
        if self.checkpointing:
            h, probs, chosen = checkpoint(self.moe, h, use_reentrant=False)
        else:
            h, probs, chosen = self.moe(h)
        return self.head(h), probs, chosen


class Trainer:
    """Cross-entropy: a token mean over the window's valid targets. aux: E · Σ_e f_e · P_e with f_e the share
    of the window's K·T routing slots that went to expert e and P_e expert e's mean router probability over
    the window's T token positions (every position routes, padding too).

    Why exact this way: f comes from counts (no gradient) that are known only when the window ends, but once
    they are, aux = Σ_e w_e · Σ_tokens p_e with w_e = E·c_e / (K·T²) is LINEAR in the per-token probabilities.
    So each micro-step but the last keeps, per expert, the gradient of its Σ_tokens p_e (E buffers), and the
    last one, whose forward completes the counts, weights those buffers by w_e and backwards its own tokens
    with w_e directly. One forward per micro-step, nothing kept but E gradients; at N=1 no buffer at all."""

    MODEL = LM
    MODE = "global"  # "micro": aux of each micro-batch alone, averaged over the micro-steps (and ranks)

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        options = spec.options or Options()
        self.model = self.MODEL(options.checkpointing).to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.n = spec.accum_steps
        self.terms = spec.terms or ("ce", "aux")  # the harness may ask for one term alone
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._reset()

    def _reset(self):
        self.counts = torch.zeros(EXPERTS + 2, dtype=torch.int64)  # per expert c_e, then valid targets, positions
        self.ce_sum = 0.0
        self.prob_sums = torch.zeros(EXPERTS, dtype=torch.float64)  # Σ_tokens p_e on this rank
        self.prob_grads = None  # [expert][parameter]: ∇ Σ_tokens p_e of micro-steps 0..N-2
        self.aux_grads = None  # micro mode: [parameter] the micro-batches' aux gradients
        self.micro_aux = 0.0
        self.loss = float("nan")

    def expert_counts(self, chosen):
        """This micro-batch's routing slots per expert, (E,) int64."""
        return torch.bincount(chosen.flatten().cpu(), minlength=EXPERTS)

    def balance_weights(self, counts, positions):
        """w_e = ∂aux / ∂(Σ_tokens p_e): AUX_WEIGHT · E · c_e / (K·T²), from the window's counts."""
        return AUX_WEIGHT * EXPERTS * counts.double() / (TOP_K * float(positions) ** 2)

    def micro_step(self, x, y, micro):
        logits, probs, chosen = self.model(x)
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        self.counts += torch.cat([self.expert_counts(chosen), torch.tensor([int((y != IGNORE).sum()), y.numel()])])
        sums = probs.sum(dim=(0, 1))  # (E,) Σ_tokens p_e of this micro-batch
        self.prob_sums += sums.detach().double().cpu()
        params = list(self.model.parameters())
        own = torch.zeros((), dtype=logits.dtype, device=logits.device)  # what this micro-step backwards now
        if "aux" in self.terms and self.MODE == "micro":
            aux = self.micro_aux_term(sums, self.expert_counts(chosen), y.numel()) / (self.n * self.world)
            self.micro_aux += float(aux.detach())
            if micro < self.n - 1:  # kept apart: the boundary divides the ce part of .grad by the count
                self.aux_grads = _add(self.aux_grads, _grad(aux, params))
            else:
                own = own + aux
        elif "aux" in self.terms and micro < self.n - 1:
            self.prob_grads = [_add(old, _grad(sums[e], params))
                               for e, old in enumerate(self.prob_grads or [None] * EXPERTS)]
        if "ce" in self.terms:
            self.ce_sum += float(ce.detach())
        if micro < self.n - 1:
            if "ce" in self.terms:
                ce.backward()  # the sum; ÷ the window's count at the boundary
            return
        # the boundary: the window's counts over every rank (int64), then every gradient, then one all-reduce
        if self.world > 1:
            dist.all_reduce(self.counts)
        valid, positions = int(self.counts[EXPERTS]), int(self.counts[EXPERTS + 1])
        for p in params:
            if p.grad is not None and "ce" in self.terms:
                p.grad.div_(max(valid, 1))
        if "ce" in self.terms:
            own = own + ce / max(valid, 1)
        aux_value = self.micro_aux
        if "aux" in self.terms and self.MODE == "global":
            w = self.balance_weights(self.counts[:EXPERTS], positions)
            aux_value = float((w * self.prob_sums).sum())
            own = own + (w.to(sums.device, sums.dtype) * sums).sum()
            self._add_to_grads(params, _weighted(self.prob_grads, w))  # micro-steps 0..N-2's share
        self._add_to_grads(params, self.aux_grads or [])
        if own.requires_grad:
            own.backward()
        local = (self.ce_sum / max(valid, 1) if "ce" in self.terms else 0.0) + aux_value
        self.loss = self._all_reduce_grads(params, local)
        self.stepping = valid > 0 if "ce" in self.terms else positions > 0  # no valid target: no step at all

    def _add_to_grads(self, params, extra):
        for p, g in zip(params, extra):
            if g is not None:
                p.grad = g.clone() if p.grad is None else p.grad + g

    def _all_reduce_grads(self, params, local_loss):
        """Σ over ranks of every gradient and of the loss, in one flat all-reduce; returns the window's loss."""
        if self.world == 1:
            return local_loss
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.flatten() for p in params] + [torch.tensor([local_loss], dtype=params[0].dtype,
                                                                                 device=params[0].device)])
            dist.all_reduce(flat)
            torch.nn.utils.vector_to_parameters(flat[:-1], [p.grad for p in params])
        return float(flat[-1])

    def micro_aux_term(self, sums, counts, positions):
        """Micro mode: aux of one micro-batch alone (its own counts and positions)."""
        return (self.balance_weights(counts, positions).to(sums.device, sums.dtype) * sums).sum()

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}

    def optimizer_step(self):
        stepping, loss = self.stepping, self.loss
        if stepping:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._reset()
        return loss if stepping else float("nan")

    def params(self):
        return dict(self.model.named_parameters())


class MicroTrainer(Trainer):
    MODE = "micro"


def _grad(value, params):
    """∇ value for every parameter (None where it does not depend on it), keeping the graph for the rest."""
    return list(torch.autograd.grad(value, params, retain_graph=True, allow_unused=True))


def _add(old, new):
    if old is None:
        return new
    return [a if b is None else b if a is None else a + b for a, b in zip(old, new)]


def _weighted(buffers, w):
    """Σ_e w_e · buffers[e], parameter by parameter (None where no expert's buffer holds a gradient)."""
    if buffers is None:
        return []
    out = []
    for i in range(len(buffers[0])):
        parts = [float(w[e]) * g[i] for e, g in enumerate(buffers) if g[i] is not None]
        out.append(sum(parts[1:], parts[0]) if parts else None)
    return out


def data(rows, seed):
    return verify.data.tokens(vocab=VOCAB, seq_len=SEQ)(rows, seed)


# objective: the ce is a token mean; aux is a function of the whole window (`batch`: checked against the big batch)
# options: checkpointing on or off, drawn by the harness (both must give the same numbers)
# data_parallel: a manual all-reduce at the boundary of micro-step N-1 (no collective before it)
def checkpointed(options, on):
    """The options with the MoE layer's recompute on or off: the path-parity gate runs both on the same windows."""
    return dataclasses.replace(options or Options(), checkpointing=on)


OBJECTIVE = verify.Objective(terms={"ce": "token_mean", "aux": "batch"})
OPTIONS = st.builds(Options, checkpointing=st.booleans())
PADDED, DP = verify.Batches(ignore_index=IGNORE), verify.Distributed(data_parallel=True)
factory = verify.adapter(data=data, batches=PADDED, objective=OBJECTIVE, options=OPTIONS, defaults=Options(),
                         distributed=DP, parity=verify.Parity(name="activation checkpointing", apply=checkpointed))(
    Trainer)
# the aux term per micro-batch: a different objective from the big batch's, declared; the ce is still checked
per_micro = verify.adapter(data=data, batches=PADDED, options=OPTIONS, defaults=Options(), distributed=DP,
                           objective=verify.Objective(terms={"ce": "token_mean", "aux": "batch"}, per_micro=("aux",)))(
    MicroTrainer)
