"""The metrics operators' edits (verify/selftest/operators.py): each takes the Mutant wrapper and the dict its
trainer's metrics() returned, and plants one reporting bug in it; `last_micro_alone` is a micro-step that
also reads the last micro-batch's own norm and loss. What each plants: docs/verify-your-trainer.md.
"""
from __future__ import annotations

import torch

__all__ = ["last_micro_alone", "shard_norm", "post_clip", "set_metric", "previous_lr", "one_micro_count", "world"]


def world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def last_micro_alone(w, x, y, m):
    """The inner trainer runs as usual; at the last micro-step the aux trainer, at its parameters, gives that
    micro-batch's own gradient norm and loss (what a trainer logging one micro-step would log)."""
    w.inner.micro_step(x, y, m)
    if m != w.N - 1:
        return
    with torch.no_grad():
        theirs = w.aux.params()
        for k, p in w.inner.params().items():
            theirs[k].copy_(p)
    w.aux.micro_step(x.clone(), y.clone(), 0)
    norm = sum(float(g.detach().double().pow(2).sum()) for g in w.aux.grads().values() if g is not None) ** 0.5
    w.own_last = (norm, float(w.aux.optimizer_step()))


def shard_norm(w, out):
    s = w.last.get("sumsq") or {}
    names = sorted(s)
    if "grad_norm" in out and len(names) > 1:
        out["grad_norm"] = sum(s[n] for n in names[::2]) ** 0.5  # every other parameter: one rank's shard
    return out


def post_clip(w, out):
    from verify._internal.metrics import max_norm_of

    cap = max_norm_of(w.declared, w.spec.options)
    if cap is not None and "grad_norm" in out:
        out["grad_norm"] = out["grad_norm"] * min(1.0, cap / (out["grad_norm"] + w.declared.clip_eps))
    return out


def set_metric(key, value):
    """An edit of the report: `key` becomes value(wrapper, reported), where the trainer reports it."""
    def edit(w, out):
        if key in out:
            out[key] = value(w, out)
        return out
    return edit


def previous_lr(w, out):
    prev, w.prev_lr = w.prev_lr, out.get("lr")
    if prev is not None and "lr" in out:
        out["lr"] = prev
    return out


def one_micro_count(w, out):
    valid, rows = w.last.get("micro_last", (0, 0))
    for key, v in (("tokens", valid), ("rows", rows)):
        if key in out:
            out[key] = float(v)
    return out
