"""Packed rows (verify.data.packed): the bugs of a per-document mean that examples/packed_documents.py gets right.
Each is that recipe's trainer with one hook changed; all declare its objective (seq_mean over count_documents).

    pack_mean             one token mean per packed row, averaged over rows (OpenRLHF PR #923: short documents
                          suppressed)
    pack_mean_per_doc     one token mean per packed row, ÷ the window's documents (the count right, the mean not)
    one_doc_per_row       per-document means, but every row counted as one document (counts over the pack)
    pack_token_mean       a token mean over the window's packed tokens
    rank_mask_no_restart  on rank > 0 the attention mask ignores the restarts (cu_seqlens built wrong on rank > 0:
                          prime-rl PR #2392, axolotl PR #2495)

Not planted: a mask that ignores the restarts on EVERY rank changes the model's function consistently — the
same objective in every split, so no accumulation invariant sees it (a model bug, not an accumulation bug).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import verify
from examples import packed_documents as recipe


def _token_means_per_row(logits, targets, doc):
    """(rows,) each packed row's token mean over all its valid targets, as if the row were one sequence."""
    valid = targets != recipe.IGNORE
    ce = F.cross_entropy(logits.flatten(0, 1), targets.clamp(min=0).flatten(), reduction="none").view_as(targets)
    return (ce * valid).sum(1) / valid.sum(1).clamp(min=1)


class _Hooked(recipe.Trainer):
    """The recipe's trainer with `numerator` (rows,) and `units` (the window's count) as hooks."""

    def numerator(self, logits, y, doc):
        return recipe.document_means(logits, y, doc)

    def units(self, x, y):
        return verify.data.count_documents(x, y).sum()

    def micro_step(self, x, y, micro):
        doc = verify.data.documents(x)
        per_row = self.numerator(self.model(x[:, 0], x[:, 1]), y, doc)
        per_row.sum().backward()
        counts = [per_row.sum().detach(), torch.as_tensor(self.units(x, y)), (y != recipe.IGNORE).sum()]
        self.window += torch.stack([c.to(self.window.dtype) for c in counts])
        if micro == self.n - 1:
            self.boundary()


class PackMean(_Hooked):
    def numerator(self, logits, y, doc):
        return _token_means_per_row(logits, y, doc)

    def units(self, x, y):
        return x.shape[0]


class PackMeanPerDoc(_Hooked):
    def numerator(self, logits, y, doc):
        return _token_means_per_row(logits, y, doc)


class OneDocPerRow(_Hooked):
    def units(self, x, y):
        return x.shape[0]


class PackTokenMean(_Hooked):
    def numerator(self, logits, y, doc):
        valid = y != recipe.IGNORE
        ce = F.cross_entropy(logits.flatten(0, 1), y.clamp(min=0).flatten(), reduction="none").view_as(y)
        return (ce * valid).sum(1)

    def units(self, x, y):
        return (y != recipe.IGNORE).sum()


class NoRestartLM(recipe.PackedLM):
    """Segments from a position_ids that never restarts: one document per row, attention across the pack."""

    def forward(self, ids, position_ids):
        return super().forward(ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids))


class RankMaskNoRestart(recipe.Trainer):
    def __init__(self, spec):
        super().__init__(spec)
        if self.distributed and dist.get_rank(self.group) > 0:  # the rank's model: same weights, wrong segments
            wrong = NoRestartLM().to(spec.device, spec.dtype)
            wrong.load_state_dict(self.model.state_dict())
            self.model = wrong
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)


def _declare(cls):
    return verify.adapter(data=recipe.factory.data, ignore_index=recipe.IGNORE, objective=recipe.objective,
                          data_parallel=True, name=f"planted packed {cls.__name__}")(cls)


pack_mean = _declare(PackMean)
pack_mean_per_doc = _declare(PackMeanPerDoc)
one_doc_per_row = _declare(OneDocPerRow)
pack_token_mean = _declare(PackTokenMean)
rank_mask_no_restart = _declare(RankMaskNoRestart)
