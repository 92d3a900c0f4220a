"""The zoo's losses, as sums: each micro-step returns, per term of its objective, the term's numerator summed
over the micro-batch's units (rows, valid tokens, sequences) and the number of those units. A term's window
value is Σ numerators / Σ units over every micro-step and rank (docs/design/numerics.md, "Normalisers"), which
a trainer gets exactly either by dividing each micro-step by its own units and N (when every micro-batch holds
the same units: rows) or by summing and dividing once the window's count is known (trainer.py).

    mse, row_ce                   regression / classification: a mean over rows
    token_mean, row_mean          an LM's cross-entropy over valid targets, or (unpadded tokens) over rows
    policy (seq_mean | token_mean | seq_sum) [+ kl]   GRPO / DAPO / Dr. GRPO on verify.data.rollouts
    doc_mean, token_mean          packed rows (verify.data.packed): a mean over documents, or over tokens
    + aux (z: router z-loss per row | balance: Switch load balancing per micro-batch)   the MoE's
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import verify

from benchmarks.zoo.models import EXPERTS

IGNORE = -100
PROMPT, COMPLETION = 3, 5
CLIP_EPS, KL_BETA, Z_WEIGHT, BALANCE_WEIGHT = 0.2, 0.05, 1e-2, 0.1


@dataclass
class Term:
    """One term of one micro-step: `num` Σ over its units (a differentiable 0-d tensor), `units` how many
    (per_micro: the term is this micro-batch's own value, averaged over the micro-steps and ranks)."""

    num: torch.Tensor
    units: float
    per_micro: bool = False


def ce_sum(logits, targets):
    """Σ cross-entropy over valid targets (ignore_index), in float32 or better whatever autocast computed."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def token_losses(logits, targets):
    """(rows, T) cross-entropy of every target, 0 where it is padding."""
    valid = targets != IGNORE
    ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.clamp(min=0).flatten(), reduction="none")
    return ce.view_as(targets) * valid, valid


def lm_terms(model, x, y, loss: str, causal: bool):
    """An LM on verify.data.tokens (inputs, next tokens) or causal_lm (inputs one longer: the model shifts)."""
    if causal:  # Hugging Face style: labels with ignore_index at position 0, logits[:, :-1] against labels[:, 1:]
        labels = verify.data.shifted_labels(y, IGNORE)
        logits = model(x, torch.arange(x.shape[1], device=x.device))[:, :-1]
        y = labels[:, 1:]
    else:
        logits = model(x, torch.arange(x.shape[1], device=x.device))
    if loss == "row_mean":  # unpadded: each row's mean over its tokens, summed over rows
        ce, _ = token_losses(logits, y)
        return {"loss": Term(ce.mean(dim=1).sum(), float(y.shape[0]))}
    return {"loss": Term(ce_sum(logits, y), float((y != IGNORE).sum()))}


def moe_terms(model, x, y, aux: str, terms):
    """A token mean, and the MoE's aux: the router z-loss (mean over a row's positions, every position routing)
    or the Switch load-balancing term of this micro-batch alone (declared per_micro)."""
    out = {}
    logits = model(x, torch.arange(x.shape[1], device=x.device))
    if "lm" in terms:
        out["lm"] = Term(ce_sum(logits, y), float((y != IGNORE).sum()))
    if "aux" in terms:
        r = model.router_logits.float()
        if aux == "z":
            out["aux"] = Term(Z_WEIGHT * torch.logsumexp(r, dim=-1).pow(2).mean(dim=1).sum(), float(x.shape[0]))
        else:
            share = torch.bincount(model.chosen.flatten(), minlength=EXPERTS).to(r.dtype) / model.chosen.numel()
            prob = r.softmax(dim=-1).flatten(0, 1).mean(dim=0)
            out["aux"] = Term(BALANCE_WEIGHT * EXPERTS * (share * prob).sum(), 1.0, per_micro=True)
    return out


def policy_terms(model, x, y, policy: str, ids: str, terms):
    """GRPO-family on verify.data.rollouts: the clipped ratio objective per completion token against the old
    policy's log-probs, and the k3 KL estimate to the reference policy. `ids`: "raw" reads every token id from
    the inputs, "helper" the completion ids of verify.data.unpack_rollouts (masked ones set to 0)."""
    r = verify.data.unpack_rollouts(x, y, IGNORE)
    full = x[:, 0].round().long() if ids == "raw" else torch.cat([r.prompt_ids, r.completion_ids], dim=1)
    logits = model(full, torch.arange(full.shape[1], device=x.device))[:, PROMPT - 1:-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, y.clamp(min=0)[..., None]).squeeze(-1)
    mask = r.completion_mask.to(logp.dtype)
    rows = float(y.shape[0])
    out = {}
    if "policy" in terms:
        ratio = torch.exp(logp - r.old_logps.to(logp.dtype))
        adv = r.advantages.to(logp.dtype)[:, None]
        per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * adv) * mask
        if policy == "seq_mean":  # GRPO: each completion's mean, over completions (an empty one counts, as 0)
            out["policy"] = Term((per_token.sum(1) / mask.sum(1).clamp(min=1)).sum(), rows)
        elif policy == "seq_sum":  # Dr. GRPO: Σ tokens / (completions × the completion length)
            out["policy"] = Term(per_token.sum() / COMPLETION, rows)
        else:  # DAPO: a mean over the window's completion tokens
            out["policy"] = Term(per_token.sum(), float(mask.sum()))
    if "kl" in terms:
        d = r.ref_logps.to(logp.dtype) - logp
        out["kl"] = Term(KL_BETA * ((torch.exp(d) - d - 1) * mask).sum(), float(mask.sum()))
    return out


def packed_terms(model, x, y, loss: str):
    """Packed rows: attention inside each document (segments), positions restarting per document."""
    ids, positions = x[:, 0], x[:, 1]
    doc = verify.data.documents(x)
    logits = model(ids, positions, segments=doc)
    if loss == "token_mean":
        return {"loss": Term(ce_sum(logits, y), float((y != IGNORE).sum()))}
    ce, valid = token_losses(logits, y)
    per_doc = torch.zeros(ce.shape, dtype=ce.dtype, device=ce.device).scatter_add(1, doc, ce)
    tokens = torch.zeros(ce.shape, dtype=ce.dtype, device=ce.device).scatter_add(1, doc, valid.to(ce.dtype))
    docs = float(verify.data.count_documents(x, y).sum())
    return {"loss": Term((per_doc / tokens.clamp(min=1)).sum(), docs)}


def dense_terms(model, x, y, loss: str):
    out = model(x).float()
    if loss == "mse":
        return {"loss": Term(((out - y) ** 2).mean(dim=1).sum(), float(y.shape[0]))}
    return {"loss": Term(F.cross_entropy(out, y, reduction="sum"), float(y.shape[0]))}

