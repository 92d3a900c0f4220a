"""Built-in batch makers for adapters: `data(rows, seed) -> (inputs, targets)`, CPU tensors, rows first.

The harness calls one once per optimizer step for the whole (global) batch and splits the rows itself,
so a maker only has to be a pure function of (rows, seed). Floating tensors are made in float64 and
cast by the harness to each run's dtype (the float64 reference sees the same numbers, unrounded).
"""
from __future__ import annotations

import torch

__all__ = ["tokens", "causal_lm", "shifted_labels", "regression", "classification", "overflow_rows", "rollouts",
           "Rollouts", "unpack_rollouts", "packed", "documents", "count_documents"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def tokens(*, vocab: int, seq_len: int):
    """Language modelling: inputs (rows, seq_len) int64 token ids in [0, vocab), targets = the next token."""
    if vocab < 2 or seq_len < 1:
        raise ValueError(f"tokens needs vocab ≥ 2 and seq_len ≥ 1, got {vocab} and {seq_len}")

    def make(rows: int, seed: int):
        seq = torch.randint(0, vocab, (rows, seq_len + 1), generator=_gen(seed))
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    return make


def causal_lm(*, vocab: int, seq_len: int):
    """For models that shift their labels internally (Hugging Face causal LMs): inputs (rows, seq_len + 1)
    token ids, targets (rows, seq_len) = inputs[:, 1:], every entry a real prediction target. The harness
    pads and counts valid targets on these; hand the model `shifted_labels(targets)` as its labels."""
    make_tokens = tokens(vocab=vocab, seq_len=seq_len)

    def make(rows: int, seed: int):
        x, y = make_tokens(rows, seed)
        return torch.cat([x, y[:, -1:]], dim=1), y

    return make


def shifted_labels(targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """HF-style labels from `causal_lm` targets: position 0 (which nothing predicts) is `ignore_index`, so
    the model's internal shift (logits[:, :-1] against labels[:, 1:]) sees exactly `targets`, and the
    number of valid labels it counts (HF's num_items_in_batch) is the harness's count of valid targets."""
    return torch.nn.functional.pad(targets, (1, 0), value=ignore_index)


def regression(*, features: int, outputs: int = 1, noise: float = 0.1):
    """inputs (rows, features) ~ N(0, 1), targets (rows, outputs) = a fixed random linear map of a
    tanh of the inputs plus noise: learnable by an MLP, float64."""

    def make(rows: int, seed: int):
        g = _gen(seed)
        w = torch.randn(features, outputs, generator=_gen(12345), dtype=torch.float64)  # the task: fixed
        x = torch.randn(rows, features, generator=g, dtype=torch.float64)
        y = torch.tanh(x) @ w + noise * torch.randn(rows, outputs, generator=g, dtype=torch.float64)
        return x, y

    return make


def classification(*, features: int, classes: int):
    """inputs (rows, features) float64, targets (rows,) int64 class ids in [0, classes)."""

    def make(rows: int, seed: int):
        g = _gen(seed)
        x = torch.randn(rows, features, generator=g, dtype=torch.float64)
        return x, torch.randint(0, classes, (rows,), generator=g)

    return make


OVERFLOW_FACTOR = 2.0**20  # a power of two: N(0, 1) inputs become ~1e6 > fp16's 65504 (inf once autocast casts them)


def overflow_rows(trainer, inputs: torch.Tensor, targets: torch.Tensor, rows: slice):
    """An overflow hook for floating inputs (numerics=verify.Numerics(overflow=verify.data.overflow_rows)): `rows` of the
    micro-batch scaled by 2^20, so the fp16 forward of those rows holds an inf (the trainer is not touched).
    New tensors. Not the default: a normalising first layer undoes the scale, the harness's injection into
    the backward (verify._internal.gates.overflow.BackwardInf) cannot be undone."""
    if not inputs.is_floating_point():
        raise ValueError("overflow_rows scales floating inputs; leave Numerics(overflow=None) for token data: the "
                         "harness then injects the overflow into the backward")
    x = inputs.clone()
    x[rows] *= OVERFLOW_FACTOR
    return x, targets


# -- policy-gradient rollouts: fixed data the harness owns, split like any batch ---------------------------

ROLLOUT_CHANNELS = 4  # token ids, old log-probs, reference log-probs, the sequence's advantage


def rollouts(*, vocab: int, prompt_len: int, completion_len: int):
    """Policy-gradient batches (GRPO / PPO-shaped), one row per sampled completion: inputs (rows, 4, P + C)
    float64 — channel 0 the prompt and completion token ids, 1 and 2 the old and the reference policy's
    log-probabilities of each completion token (0 on the prompt), 3 the row's advantage on every position —
    and targets (rows, C) int64, the completion token ids. The harness masks completion tokens by setting their
    targets to the ignore_index (padding: a completion's tail, down to an empty one; the normaliser gate: one
    completion's head): `unpack_rollouts` turns that into the loss mask, never into other ids. The rollouts are
    data, not generated: every split of a window sees the same ones."""
    if vocab < 2 or prompt_len < 1 or completion_len < 1:
        raise ValueError(f"rollouts needs vocab ≥ 2, prompt_len ≥ 1 and completion_len ≥ 1, got {vocab}, "
                         f"{prompt_len} and {completion_len}")
    P, C = prompt_len, completion_len

    def make(rows: int, seed: int):
        g = _gen(seed)
        ids = torch.randint(0, vocab, (rows, P + C), generator=g)
        old = -torch.rand(rows, C, generator=g, dtype=torch.float64) * 3.0 - 0.5  # log-probs in (-3.5, -0.5)
        ref = old + 0.2 * torch.randn(rows, C, generator=g, dtype=torch.float64)
        adv = torch.randn(rows, 1, generator=g, dtype=torch.float64)
        x = torch.zeros(rows, ROLLOUT_CHANNELS, P + C, dtype=torch.float64)
        x[:, 0] = ids.double()
        x[:, 1, P:], x[:, 2, P:] = old, ref
        x[:, 3] = adv
        return x, ids[:, P:].clone()

    return make


class Rollouts(tuple):
    """What `unpack_rollouts` returns, by name: prompt_ids (rows, P) and completion_ids (rows, C) int64, every
    token as sampled, completion_mask (rows, C) int64 (1 where the target is valid: the loss mask), advantages
    (rows,), old_logps and ref_logps (rows, C), in the inputs' floating dtype."""

    _fields = ("prompt_ids", "completion_ids", "completion_mask", "advantages", "old_logps", "ref_logps")

    def __new__(cls, *values):
        return super().__new__(cls, values)

    def __getattr__(self, name):
        if name in Rollouts._fields:
            return self[Rollouts._fields.index(name)]
        raise AttributeError(name)


def unpack_rollouts(inputs: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> Rollouts:
    """A micro-batch of `rollouts` data -> Rollouts. A masked target (== ignore_index) leaves the loss, nothing
    else: its id stays what was sampled, so the policy's input is the same whichever targets a check masks
    (docs/design/numerics.md, "Normalisers"). Feed the policy the ids and weigh the loss by completion_mask."""
    C = targets.shape[1]
    ids = inputs[:, 0].round().long()
    mask = (targets != ignore_index).long()
    return Rollouts(ids[:, :-C], ids[:, -C:], mask, inputs[:, 3, 0], inputs[:, 1, -C:], inputs[:, 2, -C:])


# -- packed rows: several documents per row, never cut by the harness ---------------------------------------

def packed(*, vocab: int, seq_len: int, max_docs: int = 3, ignore_index: int = -100):
    """Rows that pack 1..max_docs documents back to back: inputs (rows, 2, seq_len) int64 — channel 0 the
    token ids, channel 1 the position_ids, restarting at 0 where each document starts — and targets
    (rows, seq_len), each position's next token within its document; a document's last position predicts
    nothing (ignore_index), so no target crosses a document boundary. The harness splits rows, never a row:
    a document is never cut."""
    if vocab < 2 or seq_len < 2 or not 1 <= max_docs <= seq_len // 2:
        raise ValueError(f"packed needs vocab ≥ 2, seq_len ≥ 2 and 1 ≤ max_docs ≤ seq_len // 2, got {vocab}, "
                         f"{seq_len} and {max_docs}")

    def make(rows: int, seed: int):
        g = _gen(seed)
        ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
        pos = torch.zeros(rows, seq_len, dtype=torch.int64)
        y = torch.full((rows, seq_len), ignore_index, dtype=torch.int64)
        for r in range(rows):
            docs = int(torch.randint(1, max_docs + 1, (1,), generator=g))
            cuts = sorted(torch.randperm(seq_len // 2 - 1, generator=g)[:docs - 1].add(1).mul(2).tolist())
            for start, end in zip([0] + cuts, cuts + [seq_len]):  # every document ≥ 2 tokens: ≥ 1 target
                pos[r, start:end] = torch.arange(end - start)
                y[r, start:end - 1] = ids[r, start + 1:end]
        return torch.stack([ids, pos], dim=1), y

    return make


def documents(inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """`packed` inputs -> (rows, seq_len) int64 document index of every position (and so of every target) within
    its row (0, 1, ...), from where position_ids restart at 0: the segment ids of a block-diagonal mask."""
    return (inputs[:, 1] == 0).long().cumsum(dim=1) - 1


def count_documents(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`packed` inputs -> (rows,) the documents each row holds (for verify.Objective(sequences=...)): every
    document, one the harness's padding emptied included. Its `.segments` (documents) lets the normaliser gate
    halve one document of a packed row."""
    return (inputs[:, 1] == 0).sum(dim=1)


count_documents.segments = documents
